"""memory_summary(): torch.cuda.memory_summary()'s table, followed by what PyTorch cannot say
(where reserved-but-unallocated memory went, the largest free range, the top live scopes).
The table is formatted once, in C++ (gmem_memory_summary), for every language.

It composes the core (the table, tracking) with the Python layer's sections (gmem._holders):
it sits above both, and no module below imports it."""

from . import _holders, _lib, memory, observe
from ._format import format_bytes  # noqa: F401  (gmem._summary.format_bytes, as before)


def memory_summary(device=None, abbreviated=False):
    """A human-readable table of the current statistics (torch.cuda.memory_summary's layout).
    `abbreviated` is accepted for torch's signature; gmem's table is always the full one."""
    del abbreviated
    table = _lib.text(_lib.lib().gmem_memory_summary, memory.device_index(device))
    # What holds the leaked memory (when tracking found leaks) and the processes on the device
    # (NVML): the Python layer's sections (gmem.holders, docs/holders.md); they never raise.
    sections = []
    try:
        if observe.is_tracking(device):
            found = _holders._safe_holders(None, device)
            if found.targets:
                sections.append(str(found))
    except Exception as e:
        sections.append("Who holds it: not searched (%s)" % e)
    sections.append(str(_holders._safe_processes(device)))
    return table.rstrip("\n") + "\n" + "\n".join(sections) + "\n"
