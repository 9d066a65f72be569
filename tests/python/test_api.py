"""The gmem Python package over the simulated device: API shape, statistics, allocation, limits
and errors."""

import threading
import unittest

from support import GiB, MiB, round_up, run_python

import gmem


class GmemTestCase(unittest.TestCase):
    """Frees what a test allocated and lifts any limit it set, so tests stay independent."""

    def setUp(self):
        self.live = []

    def malloc(self, size, **kwargs):
        ptr = gmem.malloc(size, **kwargs)
        self.live.append(ptr)
        return ptr

    def free(self, ptr):
        self.live.remove(ptr)
        gmem.free(ptr)

    def tearDown(self):
        for ptr in self.live:
            gmem.free(ptr)
        gmem.set_memory_limit(0)
        gmem.empty_cache()


class StatsTest(GmemTestCase):
    PYTORCH_METRICS = ("allocated_bytes", "requested_bytes", "active_bytes", "reserved_bytes",
                       "inactive_split_bytes", "allocation", "active", "segment", "inactive_split")

    def test_memory_stats_has_pytorchs_names(self):
        stats = gmem.memory_stats()
        for metric in self.PYTORCH_METRICS:
            for pool in ("all", "large_pool", "small_pool"):
                for kind in ("current", "peak", "allocated", "freed"):
                    name = "%s.%s.%s" % (metric, pool, kind)
                    self.assertIn(name, stats)
                    self.assertIsInstance(stats[name], int)
        for name in ("num_alloc_retries", "num_ooms", "num_device_alloc", "num_device_free",
                     "gmem.memory_limit", "gmem.granularity"):
            self.assertIn(name, stats)
        self.assertEqual(list(stats), sorted(stats), "sorted by name, like torch.cuda.memory_stats")

    def test_one_stat_agrees_with_all(self):
        ptr = self.malloc(3 * MiB)
        stats = gmem.memory_stats()
        self.assertEqual(gmem.memory_stat("allocated_bytes.all.current"),
                         stats["allocated_bytes.all.current"])
        self.assertEqual(gmem.memory_allocated(), stats["allocated_bytes.all.current"])
        self.assertEqual(gmem.memory_reserved(), stats["reserved_bytes.all.current"])
        self.assertEqual(gmem.max_memory_allocated(), stats["allocated_bytes.all.peak"])
        self.assertEqual(gmem.max_memory_reserved(), stats["reserved_bytes.all.peak"])
        self.free(ptr)

    def test_unknown_stat_is_invalid_argument(self):
        with self.assertRaises(gmem.InvalidArgumentError) as caught:
            gmem.memory_stat("no_such.stat")
        self.assertIn("no_such.stat", str(caught.exception))

    def test_device_argument_forms(self):
        self.assertEqual(gmem.memory_allocated(0), gmem.memory_allocated(None))
        self.assertEqual(gmem.memory_allocated("cuda:0"), gmem.memory_allocated(0))  # as torch
        with self.assertRaises(TypeError):
            gmem.memory_allocated(1.5)


class AllocationTest(GmemTestCase):
    def test_small_and_large_blocks_count_rounded_to_512(self):
        base = gmem.memory_allocated()
        sizes = [1, 511, 512, 1000, 4096 + 1, MiB - 3, MiB + 1, 10 * MiB + 7]
        ptrs = [self.malloc(size) for size in sizes]
        for ptr in ptrs:
            self.assertEqual(ptr % 512, 0, "every block is 512-byte aligned")
        self.assertEqual(len(set(ptrs)), len(ptrs))
        self.assertEqual(gmem.memory_allocated() - base, sum(round_up(s) for s in sizes))
        self.assertGreaterEqual(gmem.memory_reserved(), gmem.memory_allocated())
        for ptr in ptrs:
            self.free(ptr)
        self.assertEqual(gmem.memory_allocated(), base)

    def test_peak_and_reset(self):
        base = gmem.memory_allocated()
        ptr = self.malloc(64 * MiB)
        self.free(ptr)
        self.assertGreaterEqual(gmem.max_memory_allocated(), base + 64 * MiB)
        gmem.reset_peak_memory_stats()
        self.assertEqual(gmem.max_memory_allocated(), gmem.memory_allocated())
        self.assertEqual(gmem.max_memory_reserved(), gmem.memory_reserved())

    def test_accumulated_stats_count_and_reset(self):
        gmem.reset_accumulated_memory_stats()
        for _ in range(3):
            self.free(self.malloc(2 * MiB))
        stats = gmem.memory_stats()
        self.assertEqual(stats["allocation.all.allocated"], 3)
        self.assertEqual(stats["allocated_bytes.all.freed"], 6 * MiB)
        gmem.reset_accumulated_memory_stats()
        self.assertEqual(gmem.memory_stat("allocation.all.allocated"), 0)

    def test_empty_cache_gives_free_memory_back(self):
        ptr = self.malloc(256 * MiB)
        self.free(ptr)
        self.assertGreaterEqual(gmem.memory_reserved(), 256 * MiB, "freed memory stays cached")
        gmem.empty_cache()
        self.assertEqual(gmem.memory_allocated(), 0)
        self.assertEqual(gmem.memory_reserved(), 0, "nothing live: every chunk goes back")

    def test_threads_allocate_and_free_concurrently(self):
        base = gmem.memory_allocated()
        errors = []

        def churn(seed):
            try:
                held = []
                for i in range(300):
                    held.append(gmem.malloc(512 * (1 + (seed * 31 + i * 17) % 4000)))
                    if len(held) > 20:
                        gmem.free(held.pop(0))
                for ptr in held:
                    gmem.free(ptr)
            except Exception as e:  # reported below, on the test's thread
                errors.append(e)

        threads = [threading.Thread(target=churn, args=(seed,)) for seed in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self.assertEqual(errors, [])
        self.assertEqual(gmem.memory_allocated(), base)

    def test_record_stream_accepts_a_live_block(self):
        ptr = self.malloc(MiB)
        gmem.record_stream(ptr, 0)
        self.free(ptr)


class LimitAndOomTest(GmemTestCase):
    def test_oom_raises_with_the_numbers(self):
        gmem.set_memory_limit(64 * MiB)
        self.assertEqual(gmem.memory_limit(), 64 * MiB)
        ooms = gmem.memory_stat("num_ooms")
        with self.assertRaises(gmem.OutOfMemoryError) as caught:
            gmem.malloc(128 * MiB)
        error = caught.exception
        self.assertIsInstance(error, gmem.GmemError)
        self.assertIsInstance(error, MemoryError)
        self.assertEqual(error.requested, 128 * MiB)
        message = str(error)
        self.assertIn("128.00 MiB", message, "the size asked for")
        self.assertIn("64.00 MiB", message, "the limit in force")
        self.assertEqual(gmem.memory_stat("num_ooms"), ooms + 1)
        # The program goes on: what fits under the limit is still served.
        ptr = self.malloc(32 * MiB)
        self.assertEqual(gmem.memory_allocated(), 32 * MiB)
        self.free(ptr)

    def test_limit_counts_what_is_held(self):
        gmem.set_memory_limit(64 * MiB)
        first = self.malloc(40 * MiB)
        with self.assertRaises(gmem.OutOfMemoryError):
            gmem.malloc(40 * MiB)
        self.free(first)
        second = self.malloc(40 * MiB)  # fits once the first is freed
        self.free(second)

    def test_limit_as_fraction_of_the_device(self):
        gmem.set_memory_limit(0)
        total = gmem.memory_limit()  # no cap: the device's total
        self.assertGreater(total, 0)
        gmem.set_memory_limit(0.25)
        self.assertLessEqual(abs(gmem.memory_limit() - total // 4), 2 * MiB)
        gmem.set_memory_limit(1.0)
        self.assertEqual(gmem.memory_limit(), total)

    def test_bad_limits(self):
        # float("nan") and limits that would round to nothing or exceed the device are refused,
        # and the limit in force stays
        before = gmem.memory_limit()
        for bad in (-1, 0.0, 1.5, -0.5, float("nan"), 1e-12, 2**64 - 1, 2**64 + 4096, 100):
            with self.assertRaises(gmem.InvalidArgumentError, msg=repr(bad)):
                gmem.set_memory_limit(bad)
        self.assertEqual(gmem.memory_limit(), before)
        for bad in (-1, 0.0, 1.5, -0.5):
            with self.assertRaises(gmem.InvalidArgumentError, msg=repr(bad)):
                gmem.set_memory_limit(bad)
        for bad in (True, "1GiB", None):
            with self.assertRaises(TypeError, msg=repr(bad)):
                gmem.set_memory_limit(bad)

    def test_devices_as_torch_names_them(self):
        ptr = gmem.malloc(4096)
        try:
            self.assertEqual(gmem.memory_allocated("cuda:0"), gmem.memory_allocated(0))
            self.assertEqual(gmem.memory_allocated("cuda"), gmem.memory_allocated())
            self.assertGreaterEqual(gmem.memory_allocated("cuda:0"), 4096)
        finally:
            gmem.free(ptr)
        for bad in ("cpu", "cuda:x", "cuda:-1"):
            with self.assertRaises(gmem.InvalidArgumentError, msg=bad):
                gmem.memory_allocated(bad)

    def test_star_import_has_the_observability_functions(self):
        names = {}
        exec("from gmem import *", names)
        for name in ("enable_tracking", "snapshot", "dump_snapshot", "scope", "step",
                     "last_oom_report", "memory_summary", "memory_allocated"):
            self.assertIn(name, names)

    def test_sizes_that_overflow_are_refused(self):
        with self.assertRaises(gmem.InvalidArgumentError):
            gmem.malloc(2**64 + 4096)  # would wrap to 4 KiB through ctypes
        with self.assertRaises(gmem.InvalidArgumentError):
            gmem.malloc(2**63)

    def test_sizes_that_do_not_fit_size_t_or_are_negative(self):
        # Refused before ctypes could wrap them (2**64 + 4096 would allocate 4 KiB, -4096 nearly
        # 2**64), as a ValueError whose message gives the size asked for; nothing is allocated.
        before = gmem.memory_stat("allocation.all.allocated")
        for size in (2**64 + 4096, 2**64, 2**65 + 512, 2**128, -1, -4096, -(2**64) + 4096):
            with self.assertRaises(gmem.InvalidArgumentError, msg=size) as caught:
                gmem.malloc(size)
            self.assertIsInstance(caught.exception, ValueError)
            self.assertIn("malloc(%d)" % size, str(caught.exception))
            self.assertIn("negative" if size < 0 else "larger than any device", str(caught.exception))
        self.assertEqual(gmem.memory_stat("allocation.all.allocated"), before)

    def test_pointers_and_streams_that_do_not_fit_are_refused(self):
        ptr = self.malloc(4096)
        for bad in (ptr + 2**64, ptr - 2**64, -1, 2**70):  # would wrap to ptr, or to an address
            with self.assertRaises(gmem.InvalidPointerError, msg=bad) as caught:
                gmem.free(bad)
            self.assertIn("free(%d): not an address" % bad, str(caught.exception))
            with self.assertRaises(gmem.InvalidPointerError, msg=bad):
                gmem.record_stream(bad, 0)
        for bad in (2**64, -1):  # 2**64 would wrap to the default stream
            with self.assertRaises(gmem.InvalidArgumentError, msg=bad) as caught:
                gmem.malloc(4096, stream=bad)
            self.assertIn("stream %d" % bad, str(caught.exception))
        self.free(ptr)  # still live: nothing above freed it

    def test_oom_under_the_device_capacity(self):
        with self.assertRaises(gmem.OutOfMemoryError) as caught:
            gmem.malloc(100 * GiB)  # more than the simulated 80 GiB device
        self.assertIn("100.00 GiB", str(caught.exception))


class FakeDevice:
    """Shaped like torch.device (type, index), without importing torch."""

    def __init__(self, type, index=None):
        self.type, self.index = type, index

    def __repr__(self):
        return "device(type=%r, index=%r)" % (self.type, self.index)


class IndexOnly:
    """Anything with an .index attribute is taken as a device."""

    def __init__(self, index):
        self.index = index


class DeviceArgumentTest(GmemTestCase):
    """Every function taking a device takes what torch.cuda's take: None, an int, "cuda",
    "cuda:N", a torch.device (anything with .index); a bad one is a ValueError naming it."""

    # name -> a call taking the device.
    CALLS = {
        "memory_stats": lambda d: gmem.memory_stats(d),
        "memory_stat": lambda d: gmem.memory_stat("allocated_bytes.all.current", d),
        "memory_allocated": lambda d: gmem.memory_allocated(d),
        "max_memory_allocated": lambda d: gmem.max_memory_allocated(d),
        "memory_reserved": lambda d: gmem.memory_reserved(d),
        "max_memory_reserved": lambda d: gmem.max_memory_reserved(d),
        "memory_limit": lambda d: gmem.memory_limit(d),
        "memory_summary": lambda d: gmem.memory_summary(d).splitlines()[0],
        "reset_peak_memory_stats": lambda d: gmem.reset_peak_memory_stats(d),
        "reset_accumulated_memory_stats": lambda d: gmem.reset_accumulated_memory_stats(d),
        "empty_cache": lambda d: gmem.empty_cache(d),
        "set_memory_limit": lambda d: gmem.set_memory_limit(0, d),
        "is_tracking": lambda d: gmem.is_tracking(d),
        "last_oom_report": lambda d: gmem.last_oom_report(d),
        "top_sites": lambda d: gmem.top_sites(3, d),
    }
    GOOD = (None, 0, "cuda", "cuda:0", FakeDevice("cuda", 0), FakeDevice("cuda"), IndexOnly(0),
            IndexOnly(None))
    BAD = ("cpu", "cuda:x", "cuda:", "cuda:-1", "gpu:0", "0", "", " cuda:0", "cuda:0 ", "cuda:٣",
           FakeDevice("cpu", 0), FakeDevice("meta"), 2**32, -(2**31) - 1, 2**64 + 0,
           FakeDevice("cuda", 2**40))

    def test_every_form_names_the_same_device(self):
        ptr = self.malloc(3 * MiB)
        for name, call in self.CALLS.items():
            expected = call(None)
            for device in self.GOOD:
                self.assertEqual(call(device), expected, "%s(%r)" % (name, device))
        self.assertGreaterEqual(gmem.memory_allocated(FakeDevice("cuda", 0)), 3 * MiB)
        self.free(ptr)

    def test_bad_devices_are_value_errors_naming_them(self):
        for name, call in self.CALLS.items():
            for device in self.BAD:
                with self.assertRaises(gmem.InvalidArgumentError, msg="%s(%r)" % (name, device)) as caught:
                    call(device)
                self.assertIsInstance(caught.exception, ValueError)
                self.assertIn(repr(device), str(caught.exception), name)

    def test_devices_of_another_kind_are_type_errors(self):
        for name, call in self.CALLS.items():
            for device in (1.5, True, object(), b"cuda:0", IndexOnly("0"), IndexOnly(0.0)):
                with self.assertRaises(TypeError, msg="%s(%r)" % (name, device)):
                    call(device)


class ErrorTest(GmemTestCase):
    def test_foreign_pointer(self):
        ptr = 0x12345000  # far below every address range the engine reserves
        with self.assertRaises(gmem.InvalidPointerError) as caught:
            gmem.free(ptr)
        self.assertIsInstance(caught.exception, ValueError)
        self.assertIn(hex(ptr), str(caught.exception).lower())

    def test_double_free(self):
        ptr = gmem.malloc(4096)
        gmem.free(ptr)
        with self.assertRaises(gmem.DoubleFreeError) as caught:
            gmem.free(ptr)
        self.assertIn(hex(ptr), str(caught.exception).lower())

    def test_zero_size_is_invalid(self):
        with self.assertRaises(gmem.InvalidArgumentError):
            gmem.malloc(0)

    def test_bad_arguments_are_type_errors(self):
        for bad in (1.5, "10", True, None):
            with self.assertRaises(TypeError, msg=repr(bad)):
                gmem.malloc(bad)
        with self.assertRaises(TypeError):
            gmem.malloc(512, stream=1.5)

    def test_free_none_is_a_no_op(self):
        gmem.free(0)

    def test_missing_library_is_named(self):
        result = run_python(["-c", "import gmem; gmem.memory_allocated()"],
                            GMEM_LIBRARY="/nonexistent/libgmem.so")
        self.assertNotEqual(result.returncode, 0)
        self.assertIn("GmemError", result.stderr)
        self.assertIn("/nonexistent/libgmem.so", result.stderr)


class PageSizeTest(unittest.TestCase):
    """GMEM_PAGE_SIZE (read when a device's engine is made: a child process each)."""

    CHILD = ("import gmem; p = gmem.malloc(3 << 20); "
             "print(gmem.memory_stat('gmem.granularity'), gmem.memory_reserved()); gmem.free(p)")

    def test_larger_pages_make_larger_chunks(self):
        for value, page in (("8M", 8 * MiB), ("16MiB", 16 * MiB), (str(4 * MiB), 4 * MiB)):
            result = run_python(["-c", self.CHILD], GMEM_PAGE_SIZE=value)
            self.assertEqual(result.returncode, 0, result.stderr)
            granularity, reserved = map(int, result.stdout.split())
            self.assertEqual(granularity, page, value)
            self.assertEqual(reserved, page, value)  # a 3 MiB block: one page

    # A pool (gmem_pool_create: CUDA graphs, torch.cuda.MemPool) has its device engine's pages.
    # gmem_engine_stats_t: nine stat arrays of three gmem_stat_t (four int64 each), then five
    # counters, memory_limit and granularity; reserved_bytes is the sixth array.
    POOL_CHILD = (
        "import ctypes, gmem; from gmem import _lib; L = _lib.lib(); gmem.malloc(1); "
        "pool = ctypes.c_void_p(); p = ctypes.c_void_p(); stats = (ctypes.c_int64 * 128)(); "
        "assert L.gmem_pool_create(0, ctypes.byref(pool)) == 0, _lib.last_error(); "
        "assert L.gmem_engine_malloc(pool, ctypes.byref(p), ctypes.c_size_t(3 << 20), "
        "ctypes.c_size_t(0)) == 0, _lib.last_error(); "
        "assert L.gmem_engine_stats(pool, 0, stats) == 0, _lib.last_error(); "
        "print(stats[9 * 3 * 4 + 5 + 1], stats[5 * 3 * 4]); "
        "L.gmem_engine_free(pool, p); L.gmem_pool_destroy(pool)")

    def test_pools_have_the_device_engines_pages(self):
        result = run_python(["-c", self.POOL_CHILD], GMEM_PAGE_SIZE="8M")
        self.assertEqual(result.returncode, 0, result.stderr)
        granularity, reserved = map(int, result.stdout.split())
        self.assertEqual(granularity, 8 * MiB)
        self.assertEqual(reserved, 8 * MiB)  # reserved_bytes[all]: a 3 MiB block, one page

    def test_a_bad_page_size_is_named(self):
        for value, says in (("3M", "power of two"), ("1M", "power of two"), ("8X", "byte count"),
                            ("-8M", "byte count"), ("4G", "power of two")):
            result = run_python(["-c", self.CHILD], GMEM_PAGE_SIZE=value)
            self.assertNotEqual(result.returncode, 0, value)
            self.assertIn("GMEM_PAGE_SIZE", result.stderr, value)
            self.assertIn(says, result.stderr, value)


class EmptyCacheTest(unittest.TestCase):
    """empty_cache() after every step (GMEM_EMPTY_CACHE; a child process each). The simulated
    device's clock stands still, so giving back and creating again costs all the time there is."""

    CHILD = ("import gmem\n"
             "parameters = gmem.malloc(1 << 20)\n"
             "for step in range(6):\n"
             "    blocks = [gmem.malloc(4 << 20) for _ in range(16)]\n"
             "    for p in blocks: gmem.free(p)\n"
             "    maps = gmem.memory_stat('gmem.num_maps')\n"
             "    gmem.empty_cache()\n"
             "    print(maps, gmem.memory_reserved(), gmem.memory_stat('gmem.empty_cache_kept_bytes'))\n"
             "print(gmem.memory_stat('gmem.num_empty_cache'))\n")

    def steps(self, **env):
        result = run_python(["-c", self.CHILD], **env)
        self.assertEqual(result.returncode, 0, result.stderr)
        lines = result.stdout.split("\n")
        rows = [tuple(map(int, line.split())) for line in lines[:6]]
        self.assertEqual(int(lines[6]), 6)  # gmem.num_empty_cache
        return rows, result.stderr

    def test_calls_after_every_step_keep_what_the_steps_use_and_say_so(self):
        rows, stderr = self.steps()
        self.assertEqual(rows[0][1], 2 * MiB)  # the first call gives back all but the parameters
        self.assertGreaterEqual(rows[-1][1], 64 * MiB)  # then the steps' memory stays
        self.assertGreaterEqual(rows[-1][2], 64 * MiB)
        maps = [row[0] for row in rows]
        self.assertEqual(maps[-1], maps[-2])  # the last step mapped nothing
        self.assertEqual(stderr.count("empty_cache() is called after every step"), 1, stderr)
        self.assertIn("GMEM_EMPTY_CACHE=strict", stderr)

    def test_strict_gives_back_everything_every_time(self):
        rows, stderr = self.steps(GMEM_EMPTY_CACHE="strict")
        self.assertEqual([row[1] for row in rows], [2 * MiB] * 6)
        self.assertEqual([row[2] for row in rows], [0] * 6)
        self.assertNotIn("empty_cache()", stderr)

    def test_a_bad_setting_is_named(self):
        result = run_python(["-c", "import gmem; gmem.malloc(1)"], GMEM_EMPTY_CACHE="never")
        self.assertNotEqual(result.returncode, 0)
        self.assertIn("GMEM_EMPTY_CACHE='never'", result.stderr)
        self.assertIn("auto, strict", result.stderr)


class StreamHandoversTest(unittest.TestCase):
    """GMEM_STREAM_HANDOVERS (EngineOptions::stream_handovers; a child process each)."""

    def test_settings_are_read_and_a_bad_one_is_named(self):
        for value in ("on", "off", "1", "0", ""):
            result = run_python(["-c", "import gmem; gmem.free(gmem.malloc(1 << 20))"],
                                GMEM_STREAM_HANDOVERS=value)
            self.assertEqual(result.returncode, 0, (value, result.stderr))
        result = run_python(["-c", "import gmem; gmem.malloc(1)"], GMEM_STREAM_HANDOVERS="yes")
        self.assertNotEqual(result.returncode, 0)
        self.assertIn("GMEM_STREAM_HANDOVERS='yes'", result.stderr)
        self.assertIn("on, off, 1, 0", result.stderr)


class SummaryTest(GmemTestCase):
    def test_summary_shows_current_numbers(self):
        ptr = self.malloc(3 * MiB)
        text = gmem.memory_summary()
        for row in ("Allocated memory", "GPU reserved memory", "from large pool", "Allocations"):
            self.assertIn(row, text)
        # PyTorch's units: KiB up to 10 MiB
        allocated_row = [line for line in text.splitlines() if "Allocated memory" in line][0]
        self.assertIn("%d KiB" % (gmem.memory_allocated() // 1024), allocated_row)
        self.assertIn("Reserved - allocated", text)
        self.free(ptr)

    def test_format_bytes(self):
        self.assertEqual(gmem.format_bytes(0), "0 B")
        self.assertEqual(gmem.format_bytes(1023), "1023 B")
        self.assertEqual(gmem.format_bytes(1536), "1.50 KiB")
        self.assertEqual(gmem.format_bytes(3 * GiB), "3.00 GiB")
        self.assertEqual(gmem.format_bytes(MiB - 1), "1.00 MiB")


if __name__ == "__main__":
    unittest.main()
