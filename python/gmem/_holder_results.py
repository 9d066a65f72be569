"""What gmem.holders() returns (Holders): the holders grouped by target, their report text, and
the fix each kind of holder calls for."""

from ._format import format_bytes


def _advice(kind, name, holder, what):
    name = name or "it"
    if kind == "graph":
        return ("`%s` keeps each tensor's autograd graph (%s): for inference, run it under "
                "torch.no_grad(); to keep a loss or a metric, keep `loss.item()` or "
                "`loss.detach()`, not the tensor with its graph" % (name, what))
    if kind == "hook":
        return ("`%s` keeps every output its hook sees (%s): append `o.detach().cpu()`, or remove "
                "the hook" % (name, what))
    if kind == "closure":
        return ("`%s`, kept by a closure, keeps %s: keep `t.detach().cpu()` or `.item()`, or "
                "clear it each step" % (name, what))
    if kind == "optimizer":
        return ("the optimizer's state keeps %s: it is meant to stay (made once per parameter); "
                "if it grows, parameters are being added" % what)
    if kind == "attribute":
        return ("`%s` keeps %s across steps: bound it, detach what it keeps, or keep it on the "
                "CPU" % (name, what))
    if kind == "local":
        return "`%s` (a local variable) keeps %s: `del %s` when done with it" % (name, what, name)
    if kind == "none":
        return None
    return ("`%s` keeps %s across steps: keep `t.detach().cpu()` or `.item()` in it, or clear "
            "it each step" % (name, what))


class Holders:
    """What gmem.holders() returns: for each target (a leak finding's site, an address, a site),
    its blocks grouped by what holds them. print() it for the report; .targets gives dicts:
    {"target", "blocks", "bytes", "groups": [{"holder", "kind", "name", "objects", "blocks",
    "bytes", "advice"}]}; .advice, .visited (objects), .ms, .bound (None, or why the search
    stopped early), .notes; .as_dict()."""

    def __init__(self, targets, visited=0, ms=0.0, bound=None, notes=(), heap=0):
        self.targets = targets
        self.visited = visited
        self.ms = ms
        self.bound = bound
        self.heap = heap
        self.notes = list(notes)

    @property
    def advice(self):
        """The holders' fixes, largest first, for holders of at least a quarter of what their
        target leaked (a finding's memory kept across steps; for other targets, all their
        bytes): a small holder (a local that happens to reference one block at the moment of
        the search) must not push the cause's own fix down. Every holder stays in the report's
        "Who holds it" section."""
        out = []
        for t in self.targets:
            for g in t["groups"]:
                major = 4 * g["bytes"] >= (t.get("leaked_bytes") or t.get("bytes", 0))
                if g.get("advice") and major and g["advice"] not in out:
                    out.append(g["advice"])
        return out

    def groups(self, target):
        for t in self.targets:
            if t["target"] == target:
                return t["groups"]
        return []

    def as_dict(self):
        return {"targets": self.targets, "visited": self.visited, "ms": round(self.ms, 1),
                "bound": self.bound, "heap_objects": self.heap, "notes": self.notes,
                "advice": self.advice}

    def header(self):
        head = "Who holds it (Python objects that reference the memory; %d objects visited in %.0f ms" \
            % (self.visited, self.ms)
        if self.bound:
            head += "; the search stopped at %s: chains may end short of their root" % self.bound
        return head + "):"

    def __str__(self):
        lines = [self.header()]
        for note in self.notes:
            lines.append("  " + note)
        for t in self.targets:
            lines.append("  %s: %d block%s, %s" % (t["target"], t["blocks"],
                                                  "" if t["blocks"] == 1 else "s",
                                                  format_bytes(t["bytes"])))
            if t.get("why"):
                lines.append("    " + t["why"])
            for g in t["groups"]:
                if g["kind"] == "none":
                    lines.append("    %s, %s: %s" % (_count(g["blocks"], "block"),
                                                     format_bytes(g["bytes"]), g["holder"]))
                    continue
                what = _count(g["objects"], g["noun"]) + (
                    " (view%s)" % ("" if g["objects"] == 1 else "s") if g.get("view") else "")
                lines.append("    %s, %s in %d block%s, kept by %s" % (
                    what, format_bytes(g["bytes"]), g["blocks"], "" if g["blocks"] == 1 else "s",
                    g["holder"]))
        return "\n".join(lines)

    def __repr__(self):
        return "<gmem.Holders: %d target(s), %d group(s), %d objects visited in %.0f ms>" % (
            len(self.targets), sum(len(t["groups"]) for t in self.targets), self.visited, self.ms)


def _count(n, noun):
    return "%d %s%s" % (n, noun, "" if n == 1 else "s")
