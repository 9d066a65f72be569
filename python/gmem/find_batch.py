"""gmem.find_executable_batch_size: the shape of accelerate's decorator, measuring instead of
halving the batch after each out-of-memory."""

import functools
import gc

from . import observe
from ._fit_run import _torch, is_out_of_memory
from .fit import fit_batch_size

class _StepDone(BaseException):
    """Ends a probe's run of the user's function after its first steps. A BaseException, so that
    a training loop's `except Exception` does not swallow it."""


class _StopAfterSteps:
    """Raises _StepDone once `steps` steps have ended: after optimizer.step() (torch's global
    post-hook) or gmem.step()."""

    def __init__(self, steps):
        self.steps = steps
        self.seen = 0
        self._handle = None

    def _ended(self, *args):
        self.seen += 1
        if self.seen >= self.steps:
            raise _StepDone()

    def __enter__(self):
        observe.step_listeners.append(self._ended)
        if _torch() is not None:
            from torch.optim.optimizer import register_optimizer_step_post_hook
            self._handle = register_optimizer_step_post_hook(self._ended)
        return self

    def __exit__(self, *exc):
        observe.step_listeners.remove(self._ended)
        if self._handle is not None:
            self._handle.remove()
        return False


def find_executable_batch_size(function=None, starting_batch_size=128, steps_per_probe=2,
                               **fit_options):
    """A decorator with the shape of accelerate's find_executable_batch_size, that measures
    instead of halving after each out-of-memory:

        @gmem.find_executable_batch_size(starting_batch_size=128)
        def train(batch_size, epochs):
            model, optimizer = make_model()      # made inside, as accelerate asks
            for batch in loader(batch_size): ...
        train(3)                                 # runs at the largest batch size that fits

    The function is first run as a probe at a few small batch sizes, each stopped after
    `steps_per_probe` steps (a step ends at optimizer.step() or gmem.step(); two, so that the
    optimizer state the first step creates is in the peak); then once, to the end, at the pick
    (fit_batch_size's, at most starting_batch_size). Should that run still run out of memory,
    it is run again at a smaller size, as accelerate does. The fit is kept as `train.fit`."""
    if function is None:
        return lambda f: find_executable_batch_size(f, starting_batch_size, steps_per_probe,
                                                    **fit_options)
    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        def probe(batch_size):
            try:
                with _StopAfterSteps(steps_per_probe):
                    function(batch_size, *args, **kwargs)
            except _StepDone:
                pass

        fit = fit_batch_size(probe, max_batch_size=starting_batch_size, **fit_options)
        wrapper.fit = fit
        batch_size = fit.batch_size
        while True:
            try:
                return function(batch_size, *args, **kwargs)
            except Exception as e:  # noqa: BLE001 (anything but out-of-memory is re-raised)
                if not is_out_of_memory(e) or batch_size == 1:
                    raise
                e.__traceback__ = None
                del e
                gc.collect()
                batch_size = max(1, batch_size - max(1, batch_size // 8))
                fit.notes.append("the run at the pick ran out of memory; ran again at %d"
                                 % batch_size)

    wrapper.fit = None
    return wrapper
