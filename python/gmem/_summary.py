"""memory_summary(): torch.cuda.memory_summary()'s table, answered from gmem's statistics,
followed by what PyTorch cannot say: where reserved-but-unallocated memory went."""

from . import memory

_METRICS = [
    ("allocated_bytes", "Allocated memory", True),
    ("active_bytes", "Active memory", True),
    ("requested_bytes", "Requested memory", True),
    ("reserved_bytes", "GPU reserved memory", True),
    ("inactive_split_bytes", "Non-releasable memory", True),
    ("allocation", "Allocations", False),
    ("active", "Active allocs", False),
    ("segment", "GPU reserved chunks", False),
    ("inactive_split", "Non-releasable allocs", False),
]

_WASTE = [
    ("gmem.free_mapped_bytes", "cached, mapped"),
    ("gmem.free_unmapped_bytes", "cached, unmapped"),
    ("gmem.partial_page_bytes", "partial pages"),
    ("gmem.small_slack_bytes", "small-block slack"),
]


def format_bytes(n):
    """1536 -> '1.50 KiB' (the same units as gmem's C++ messages)."""
    n = int(n)
    sign = "-" if n < 0 else ""
    value = float(abs(n))
    if value < 1024:
        return "%s%d B" % (sign, abs(n))
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        value /= 1024.0
        if value < 1023.995:
            break
    return "%s%.2f %s" % (sign, value, unit)


def _cell(value, is_bytes):
    return "%10s" % (format_bytes(value) if is_bytes else value)


def memory_summary(device=None, abbreviated=False):
    """A human-readable table of the current statistics (torch.cuda.memory_summary's layout)."""
    stats = memory.memory_stats(device)
    dev = memory.device_index(device)
    width = 75
    lines = ["=" * width,
             " gmem CUDA memory summary, device %s" % ("current" if dev < 0 else dev),
             "-" * width,
             "  OOMs: %-10d | alloc retries: %-8d | device allocs: %-8d"
             % (stats.get("num_ooms", 0), stats.get("num_alloc_retries", 0),
                stats.get("num_device_alloc", 0)),
             "=" * width,
             "        Metric         | Cur Usage  | Peak Usage | Tot Alloc  | Tot Freed  "]
    pools = [("all", None)] if abbreviated else [
        ("all", None), ("large_pool", "      from large pool"), ("small_pool", "      from small pool")]
    for key, title, is_bytes in _METRICS:
        lines.append("-" * width)
        for pool, label in pools:
            prefix = "%s.%s." % (key, pool)
            cells = [_cell(stats.get(prefix + kind, 0), is_bytes)
                     for kind in ("current", "peak", "allocated", "freed")]
            lines.append(" %-21s | %s " % (label or title, " | ".join(cells)))
    lines.append("=" * width)
    reserved = stats.get("reserved_bytes.all.current", 0)
    allocated = stats.get("allocated_bytes.all.current", 0)
    lines.append(" gmem: limit %s, %d chunks of %s held (%d mapped), %d maps, %d unmaps, %d stitches"
                 % (format_bytes(stats.get("gmem.memory_limit", 0)), stats.get("gmem.chunks_held", 0),
                    format_bytes(stats.get("gmem.granularity", 0)), stats.get("gmem.chunks_mapped", 0),
                    stats.get("gmem.num_maps", 0), stats.get("gmem.num_unmaps", 0),
                    stats.get("gmem.num_stitches", 0)))
    waste = ", ".join("%s %s" % (label, format_bytes(stats.get(key, 0))) for key, label in _WASTE)
    lines.append(" reserved - allocated = %s: %s" % (format_bytes(reserved - allocated), waste))
    lines.append(" largest free range already backed: %s"
                 % format_bytes(stats.get("gmem.largest_free_range", 0)))
    lines.append("=" * width)
    return "|" + "|\n|".join(lines) + "|\n"
