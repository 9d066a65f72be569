"""gmem.fit_batch_size and its kin, on the simulated device, with synthetic steps whose memory
is known exactly: the largest batch that fits is computed by hand and the fit must find it,
within the steps it promises, and leave gmem as it found it."""

import threading
import unittest

from support import GiB, MiB, assert_child_ok

import gmem
from gmem import _fit_ranks


class SyntheticStep:
    """One training step of a model that is known exactly: `weights` live before the fit, the
    optimizer's `state` created by the first step, `grads` each step, then `per_sample` bytes of
    activations a sample (plus `quadratic` * b^2), all live at the peak. `optimizer_peak`: a
    transient of that size after the activations are gone (foreach optimizers), which is the
    step's peak at small batches. Frees all it allocates but the state, even when it fails."""

    def __init__(self, weights=200 * MiB, state=300 * MiB, grads=100 * MiB, per_sample=40 * MiB,
                 quadratic=0, optimizer_peak=0, noise=None):
        self.weights = gmem.malloc(weights)
        self.state_size, self.grads, self.per_sample = state, grads, per_sample
        self.quadratic, self.optimizer_peak, self.noise = quadratic, optimizer_peak, noise
        self.state = None
        self.calls = []

    def peak(self, b):
        """The step's peak allocated bytes once its state exists (512 B rounding aside)."""
        held = self.weights_size() + self.state_size + self.grads
        return held + max(self.per_sample * b + self.quadratic * b * b, self.optimizer_peak)

    def weights_size(self):
        return 200 * MiB if self.weights else 0

    def __call__(self, b):
        self.calls.append(b)
        if self.state is None:
            self.state = gmem.malloc(self.state_size)
        held = [gmem.malloc(self.grads)]
        try:
            size = self.per_sample * b + self.quadratic * b * b
            if self.noise is not None:
                size += self.noise(b)
            held.append(gmem.malloc(size))
            gmem.free(held.pop())
            if self.optimizer_peak:
                held.append(gmem.malloc(self.optimizer_peak))
        finally:
            for ptr in held:
                gmem.free(ptr)

    def close(self):
        for ptr in (self.weights, self.state):
            if ptr:
                gmem.free(ptr)


def largest(step, budget):
    b = 0
    while step.peak(b + 1) <= budget:
        b += 1
    return b


class FitBatchSizeTest(unittest.TestCase):
    def setUp(self):
        self.baseline = gmem.memory_allocated()
        self.limit = 4 * GiB

    def tearDown(self):
        self.step.close()
        self.assertEqual(gmem.memory_allocated(), self.baseline, "the fit left blocks allocated")

    def fit(self, **options):
        options.setdefault("limit", self.limit)
        return gmem.fit_batch_size(self.step, **options)

    def test_affine_step_is_predicted_in_three_probes_and_one_verified_step(self):
        self.step = SyntheticStep()
        fit = self.fit()
        self.assertEqual(fit.batch_size, largest(self.step, self.limit))
        self.assertEqual(fit.method, "predicted")
        self.assertTrue(fit.affine)
        self.assertEqual([s.kind for s in fit.steps], ["probe", "probe", "probe", "verify"])
        self.assertEqual(self.step.calls, [s.batch_size for s in fit.steps])
        # The parts, as the step builds them (allocations are rounded to 512 B).
        self.assertEqual(fit.per_sample, 40 * MiB)
        self.assertEqual(fit.resident, 500 * MiB)
        self.assertEqual(fit.step_fixed, 100 * MiB)
        self.assertAlmostEqual(fit.measured_peak / fit.predicted_peak, 1.0, places=3)
        self.assertEqual(fit.out_of_memory_caught, 0)
        self.assertIn("batch size %d fits" % fit.batch_size, str(fit))
        # The probes' peaks are not the program's: peaks start again after the fit.
        self.assertEqual(gmem.max_memory_allocated(), gmem.memory_allocated())
        self.assertEqual(gmem.memory_limit(), gmem.memory_stat("gmem.device_total_bytes"),
                         "the limit of the fit was not taken off again")
        as_dict = fit.as_dict()
        self.assertEqual(as_dict["batch_size"], fit.batch_size)
        self.assertEqual(len(as_dict["steps"]), 4)

    def test_noisy_step_picks_the_largest_or_one_below_and_never_raises(self):
        # Each step allocates up to 1% of a sample more or less than the line says.
        flip = [0]

        def noise(b):
            flip[0] += 1
            return (1 if flip[0] % 2 else -1) * (self.step.per_sample // 100) * b // 4

        self.step = SyntheticStep(noise=noise)
        fit = self.fit()
        truth = largest(self.step, self.limit)
        self.assertIn(fit.batch_size, (truth - 1, truth))
        self.assertLessEqual(len(fit.steps), 8)

    def test_non_affine_step_is_said_so_and_searched(self):
        # Attention-like: memory grows with the square of the batch.
        self.step = SyntheticStep(per_sample=8 * MiB, quadratic=2 * MiB)
        fit = self.fit()
        truth = largest(self.step, self.limit)
        self.assertEqual(fit.method, "searched")
        self.assertFalse(fit.affine)
        self.assertTrue(any("faster than a line" in n or "not affine" in n for n in fit.notes),
                        fit.notes)
        self.assertIn(fit.batch_size, (truth - 1, truth))
        self.assertLessEqual(len(fit.steps), 8)

    def test_optimizer_peak_at_small_batches_does_not_hide_the_activations(self):
        # Below 20 samples the step peaks in its optimizer step: the first probes see no slope.
        self.step = SyntheticStep(per_sample=40 * MiB, optimizer_peak=800 * MiB)
        fit = self.fit()
        truth = largest(self.step, self.limit)
        self.assertIn(fit.batch_size, (truth - 1, truth))
        self.assertLessEqual(len(fit.steps), 8)

    def test_out_of_memory_inside_a_probe_is_caught_and_searched_below(self):
        self.step = SyntheticStep(per_sample=400 * MiB)
        fit = self.fit(probes=[1, 2, 9])  # 9 samples need 3.6 GiB more than the 4 GiB
        truth = largest(self.step, self.limit)
        self.assertEqual(fit.batch_size, truth)
        self.assertGreaterEqual(fit.out_of_memory_caught, 1)
        self.assertEqual(fit.upper_bound, truth + 1)
        self.assertFalse(fit.steps[2].ok)
        self.assertIn("out of memory", fit.steps[2].error)

    def test_nothing_fits_is_a_clear_error(self):
        self.step = SyntheticStep(per_sample=8 * GiB)
        with self.assertRaises(gmem.FitError) as caught:
            self.fit()
        self.assertIn("not even batch size 1 fits", str(caught.exception))
        self.assertEqual(len(caught.exception.fit.steps), 1)

    def test_max_batch_size_bounds_the_pick(self):
        self.step = SyntheticStep(per_sample=1 * MiB)
        fit = self.fit(max_batch_size=50)
        self.assertEqual(fit.batch_size, 50)
        self.assertTrue(all(s.batch_size <= 50 for s in fit.steps))

    def test_errors_other_than_out_of_memory_reach_the_caller(self):
        self.step = SyntheticStep()

        def broken(b):
            self.step(b)
            if b > 2:
                raise KeyError("a bug in the step")

        with self.assertRaises(KeyError):
            gmem.fit_batch_size(broken, limit=self.limit)

    def test_bad_arguments_are_refused(self):
        self.step = SyntheticStep()
        for options in ({"probes": [3]}, {"probes": [4, 2]}, {"probes": [0, 1]},
                        {"max_batch_size": 0}, {"tolerance": 2}):
            with self.assertRaises(gmem.InvalidArgumentError):
                self.fit(**options)
        self.assertEqual(self.step.calls, [])

    def test_restore_puts_state_back(self):
        self.step = SyntheticStep()

        class Model:
            def __init__(self):
                self.value = {"w": 1}

            def state_dict(self):
                return dict(self.value)

            def load_state_dict(self, state):
                self.value = dict(state)

        model = Model()
        stepped = self.step

        def step(b):
            stepped(b)
            model.value["w"] += 1

        gmem.fit_batch_size(step, limit=self.limit, restore=model)
        self.assertEqual(model.value, {"w": 1})

    def test_what_fits_without_torch_gives_the_fit_and_accumulation(self):
        self.step = SyntheticStep()
        table = gmem.what_fits(self.step, limit=self.limit, target_batch_size=200)
        truth = largest(self.step, self.limit)
        self.assertEqual(table.rows[1].setting, "as is")
        best = table.recommendation
        self.assertEqual(best.accumulation_steps * best.micro_batch >= 200, True)
        self.assertLessEqual(best.micro_batch, truth)
        self.assertIn("<- recommended", str(table))
        self.assertIn("accumulating", best.setting)


class SequenceLengthTest(unittest.TestCase):
    def test_a_cap_on_sequence_length_and_the_per_token_parts(self):
        # A sample at length L holds 64 KiB a token and 16 B a token squared (attention-like).
        baseline = gmem.memory_allocated()
        weights = gmem.malloc(256 * MiB)

        def per_sample(length):
            return 64 * 1024 * length + 16 * length * length

        def step(batch_size, length):
            p = gmem.malloc(64 * MiB + per_sample(length) * batch_size)
            gmem.free(p)

        try:
            table = gmem.what_fits(step, seq_len=2048, shorter=(512, 1024), limit=4 * GiB)
        finally:
            gmem.free(weights)
        self.assertEqual(gmem.memory_allocated(), baseline)
        rows = {r.setting: r for r in table.rows}
        for length in (512, 1024):
            row = rows["sequence length %d" % length]
            truth = (4 * GiB - 320 * MiB) // per_sample(length)
            self.assertIn(row.batch_size, (truth - 1, truth), (length, row.batch_size, truth))
            self.assertTrue(row.how.startswith("measured"))
        self.assertAlmostEqual(table.per_token / (64 * 1024), 1.0, places=2)
        self.assertAlmostEqual(table.per_token_squared / 16, 1.0, places=1)
        self.assertIn("x L^2", str(table))


class FitUnderALimitFractionTest(unittest.TestCase):
    def test_limit_set_as_a_fraction_is_the_budget(self):
        # A fresh engine: 5% of the simulated 80 GiB device, set before the fit.
        assert_child_ok(self, r"""
import gmem
gmem.set_memory_limit(0.05)
MiB = 1 << 20
def step(b):
    p = gmem.malloc(100 * MiB + 64 * MiB * b)
    gmem.free(p)
fit = gmem.fit_batch_size(step)
budget = gmem.memory_limit()
assert fit.budget == budget, (fit.budget, budget)
truth = max(b for b in range(1, 1000) if 100 * MiB + 64 * MiB * b <= budget)
assert fit.batch_size == truth, (fit.batch_size, truth)
assert gmem.memory_limit() == budget
print("ok")
""", GMEM_DEVICE="sim")


class DecoratorTest(unittest.TestCase):
    def test_shape_of_accelerates_decorator(self):
        baseline = gmem.memory_allocated()
        runs = []

        @gmem.find_executable_batch_size(starting_batch_size=64, limit=2 * GiB)
        def train(batch_size, epochs):
            runs.append(batch_size)
            weights = gmem.malloc(256 * MiB)  # made inside, as accelerate asks
            try:
                for _ in range(epochs):
                    acts = gmem.malloc(96 * MiB * batch_size)
                    gmem.free(acts)
                    gmem.step()
            finally:
                gmem.free(weights)
            return batch_size

        got = train(5)
        truth = (2 * GiB - 256 * MiB) // (96 * MiB)
        self.assertEqual(got, truth)
        self.assertEqual(train.fit.batch_size, truth)
        self.assertEqual(runs[-1], truth)  # the real run, at the pick
        self.assertEqual(gmem.memory_allocated(), baseline)


class FakeStore:
    """The part of torch.distributed's store the agreement uses, for threads."""

    def __init__(self):
        self.values = {}
        self.changed = threading.Condition()

    def set(self, key, value):
        with self.changed:
            self.values[key] = value.encode()
            self.changed.notify_all()

    def get(self, key):
        return self.values[key]

    def check(self, keys):
        return all(k in self.values for k in keys)

    def wait(self, keys, timeout):
        with self.changed:
            if not self.changed.wait_for(lambda: self.check(keys), timeout.total_seconds()):
                raise RuntimeError("Wait timeout")


RANK_CHILD = r"""
import json, os, sys, time
import gmem
from gmem import _fit_ranks

class FileStore:
    # The part of torch.distributed's store the agreement uses, over files in a folder.
    def __init__(self, root):
        self.root = root
    def _path(self, key):
        return os.path.join(self.root, key.replace("/", "_"))
    def set(self, key, value):
        tmp = self._path(key) + ".tmp"
        with open(tmp, "w") as f:
            f.write(value)
        os.replace(tmp, self._path(key))
    def get(self, key):
        with open(self._path(key)) as f:
            return f.read().encode()
    def check(self, keys):
        return all(os.path.exists(self._path(k)) for k in keys)
    def wait(self, keys, timeout):
        deadline = time.monotonic() + timeout.total_seconds()
        while not self.check(keys):
            if time.monotonic() > deadline:
                raise RuntimeError("Wait timeout")
            time.sleep(0.005)

rank, world, root, limit = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
MiB = 1 << 20
weights = gmem.malloc(300 * MiB)
def step(b):
    p = gmem.malloc(100 * MiB + 48 * MiB * b)
    gmem.free(p)
agreement = _fit_ranks._Agreement(FileStore(root), rank, world, timeout=20, prefix="fit/1/")
try:
    fit = gmem.fit_batch_size(step, limit=limit, _agreement=agreement)
    print(json.dumps({"batch_size": fit.batch_size, "sizes": [p.batch_size for p in fit.steps]}))
except gmem.FitError as e:
    print(json.dumps({"error": str(e)}))
"""


class RanksTest(unittest.TestCase):
    """Ranks in separate processes (each its own simulated device and limit) agreeing through a
    store: every rank runs the same batch sizes, and all take the smallest rank's pick."""

    def run_ranks(self, limits):
        import json
        import subprocess
        import sys
        import tempfile
        from support import child_env
        with tempfile.TemporaryDirectory() as root:
            children = [subprocess.Popen(
                [sys.executable, "-c", RANK_CHILD, str(rank), str(len(limits)), root, str(limit)],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, universal_newlines=True,
                env=child_env(GMEM_DEVICE="sim")) for rank, limit in enumerate(limits)]
            results = []
            for child in children:
                out, err = child.communicate(timeout=120)
                self.assertEqual(child.returncode, 0, out + err)
                results.append(json.loads(out.strip().splitlines()[-1]))
            return results

    def test_ranks_run_the_same_steps_and_take_the_smallest_pick(self):
        results = self.run_ranks([3 * GiB, 4 * GiB])
        smallest = (3 * GiB - 400 * MiB) // (48 * MiB)
        self.assertEqual([r["batch_size"] for r in results], [smallest, smallest], results)
        self.assertEqual(results[0]["sizes"], results[1]["sizes"])

    def test_a_rank_that_cannot_fit_anything_fails_every_rank(self):
        results = self.run_ranks([300 * MiB + 64 * MiB, 4 * GiB])
        for r in results:
            self.assertIn("error", r, results)


class AgreementTest(unittest.TestCase):
    def test_ranks_take_the_smallest_value(self):
        store = FakeStore()
        results = {}

        def rank(r, value):
            results[r] = _fit_ranks._Agreement(store, r, 3, timeout=10, prefix="t1/").min(value)

        threads = [threading.Thread(target=rank, args=(r, v)) for r, v in enumerate((12, 9, 15))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self.assertEqual(results, {0: 9, 1: 9, 2: 9})

    def test_a_rank_that_never_answers_fails_the_others_in_bounded_time(self):
        store = FakeStore()
        with self.assertRaises(gmem.FitError) as caught:
            _fit_ranks._Agreement(store, 0, 2, timeout=0.2, prefix="t2/").min(5)
        self.assertIn("rank 1 did not answer", str(caught.exception))


if __name__ == "__main__":
    unittest.main()
