"""gmem's errors as Python exceptions: one class per status code of the C API (gmem.h), and
FitError, for gmem.fit_batch_size."""


class GmemError(RuntimeError):
    """Any failure reported by gmem. A RuntimeError, like PyTorch's own CUDA errors."""


class InvalidArgumentError(GmemError, ValueError):
    """A request gmem cannot take: a size of 0, an absurd size, a bad option."""


class OutOfMemoryError(GmemError, MemoryError):
    """An allocation gmem could not serve, under its memory limit or from the device.

    The message (from gmem) gives the numbers: bytes asked for, held, allocated, the limit and
    what the device has free. `requested` is the size that failed, in bytes.
    """

    def __init__(self, message, requested=None):
        super().__init__(message)
        self.requested = requested


class InvalidPointerError(GmemError, ValueError):
    """A pointer gmem never handed out (freed with the wrong allocator, say)."""


class DoubleFreeError(GmemError, ValueError):
    """A pointer freed twice."""


class DeviceError(GmemError):
    """A CUDA driver call failed for a reason other than memory."""


class FitError(GmemError):
    """No batch size fits, or the fit could not go on; the message says what was measured.
    `.fit` holds what was learned so far (a Fit, whose .steps lists the steps run)."""

    def __init__(self, message, fit=None):
        super().__init__(message)
        self.fit = fit


class BadInputError(GmemError, ValueError):
    """A malformed input file (trace, snapshot); the message names the file and line."""


# Status codes of gmem_status_t, in the order of include/gmem/gmem.h.
STATUS_OK = 0
_BY_STATUS = {
    1: InvalidArgumentError,
    2: OutOfMemoryError,
    3: InvalidPointerError,
    4: DoubleFreeError,
    5: DeviceError,
    6: BadInputError,
}


def error_for_status(status, message, requested=None):
    """The exception for a failed call's status code and gmem's message."""
    cls = _BY_STATUS.get(status, GmemError)
    if not message:
        message = "gmem call failed with status %d" % status
    if cls is OutOfMemoryError:
        return OutOfMemoryError(message, requested=requested)
    return cls(message)
