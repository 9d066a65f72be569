"""How gmem's reports write things: byte counts (format_bytes, gmem.format_bytes) and the report
layout the Python layer adds sections to (_insert_sections). A leaf: it imports no gmem module,
so that every layer of the package can use it."""


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


def _insert_sections(text, sections, advice):
    """`text` (a report with a "What to do:" list) with `sections` before that list and `advice`
    first in it; appended at the end when the report has no such list."""
    sections = [s for s in sections if s]
    marker = "What to do:"
    at = text.find("\n" + marker)
    bullets = "".join("  - %s\n" % a for a in advice)
    if at < 0:
        out = text.rstrip("\n")
        for s in sections:
            out += "\n" + s
        if bullets:
            out += "\n" + marker + "\n" + bullets.rstrip("\n")
        return out + ("\n" if text.endswith("\n") else "")
    head, tail = text[:at + 1], text[at + 1 + len(marker):]
    middle = "".join(s + "\n" for s in sections)
    return head + middle + marker + "\n" + bullets + tail.lstrip("\n")
