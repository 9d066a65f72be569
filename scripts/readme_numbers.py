#!/usr/bin/env python3
"""Writes every measured number that README.md (and docs/*.md) shows from the result files in
bench/results, so that the docs cannot drift from the measurements.

A generated block sits between two markers, and everything between them is replaced:

    <!-- numbers:NAME -->
    ...
    <!-- /numbers -->

NAME is one of BLOCKS below. To show newer results, record them in bench/results (a new dated
file), point the SOURCES below at it, and run this script; commit the result files and the docs
together.

    python3 scripts/readme_numbers.py           rewrite the blocks in place
    python3 scripts/readme_numbers.py --check   exit 1, with a diff, if any block is out of date

Standard library only: tests/python/test_docs.py runs --check under plain python3.
"""
import difflib
import json
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The result files the docs quote. Change these (and rerun) to show a newer run.
SOURCES = {
    # `gmem replay tests/data/*.trace.csv.gz` on the simulated device, as README's first command.
    "replay": "bench/results/2026-11-28-vm-replay.txt",
    # ... and as README's first command prints it (100 columns and the legend).
    "replay_default": "bench/results/2026-11-28-vm-replay-default.txt",
    # The latest scripts/gpu-check on an H200: .json for the numbers, .txt for the printed table.
    "gpu_json": "bench/results/2026-11-29-nvidia-h200-session36.json",
    "gpu_txt": "bench/results/2026-11-29-nvidia-h200-session36.txt",
    # train_bench.py's runs under native and gmem alternated on the same GPU right after that
    # gpu-check (None: none were run), one process each: quoted under the table, model by model
    # (median steps; Llama's timed totals), gmem at its default page size.
    "ab": "bench/results/2026-11-29-nvidia-h200-session36-ab.jsonl",
    # An OOM report as the current build prints it (the leak under a cap, on the simulated device).
    "oom": "bench/results/2026-11-28-vm-oom-report.txt",
    # gmem.fit_batch_size on an H200: the table of bench/torch/fit_suite.sh, and what the fit and
    # what_fits print for GPT-2.
    "fit": "bench/results/2026-11-28-nvidia-h200-fit.txt",
    "fit_gpt2": "bench/results/2026-11-28-nvidia-h200-fit-gpt2.txt",
}

# The files whose blocks are generated.
FILES = ["README.md", "docs/benchmarks.md", "docs/replay.md", "docs/fit.md"]

BLOCK = re.compile(r"(<!-- numbers:([a-z0-9-]+) -->\n)(.*?)(<!-- /numbers -->)", re.S)


def read(rel):
    with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
        return f.read()


def link(rel, from_file):
    """A markdown link to ROOT-relative `rel`, relative to the doc `from_file`."""
    path = os.path.relpath(os.path.join(ROOT, rel), os.path.dirname(os.path.join(ROOT, from_file)))
    return "[%s](%s)" % (os.path.basename(rel), path)


# --- gmem replay's recorded output ---------------------------------------------------------------


def replay_header(text):
    """The `# key: value` lines at the top of a recorded result."""
    return dict(re.findall(r"^# ([a-z ]+): (.*)$", text, re.M))


def replay_rows(text):
    """The replay table as dicts: trace, events, peak_allocated, pytorch_reserved (with its
    ratio), gmem_reserved, min_capacity, calls, ns_op, device_ms. Columns are separated by two
    spaces or more, as gmem replay prints them."""
    lines = [l for l in text.splitlines() if l and not l.startswith("#")]
    head = next(i for i, l in enumerate(lines) if l.startswith("trace "))
    rows = []
    for line in lines[head + 1:]:
        cells = re.split(r"\s{2,}", line.strip())
        if len(cells) < 9:
            break
        rows.append(dict(zip(["trace", "events", "peak_allocated", "pytorch_reserved", "gmem_reserved",
                              "min_capacity", "calls", "ns_op", "device_ms"], cells)))
    if not rows:
        raise SystemExit("%s: no replay table found" % SOURCES["replay"])
    return rows


def ratio(cell):
    return float(re.search(r"\(([\d.]+)\)", cell).group(1))


def block_replay(doc):
    rows = replay_rows(read(SOURCES["replay"]))
    h = replay_header(read(SOURCES["replay"]))
    out = ["| trace | peak allocated | PyTorch reserved | gmem reserved | smallest device for gmem | gmem's device ms a step |",
           "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        out.append("| %s | %s | %s | **%s** | %s | %s |" % (
            r["trace"], r["peak_allocated"], r["pytorch_reserved"], r["gmem_reserved"], r["min_capacity"],
            r["device_ms"]))
    out.append("")
    out.append("`%s` on %s, %s, at %s (%s). Ratios are over peak allocated." % (
        h.get("command", "gmem replay tests/data/*.trace.csv.gz"), h.get("device", "—"),
        h.get("date", "—"), h.get("commit", "—"), link(SOURCES["replay"], doc)))
    return "\n".join(out)


def block_replay_output(doc):
    text = read(SOURCES["replay_default"])
    body = "\n".join(l for l in text.splitlines() if not l.startswith("#")).strip("\n")
    h = replay_header(text)
    return "```\n$ %s\n%s\n```\n\n(%s, %s, at %s: %s.)" % (
        h.get("command", "gmem replay tests/data/*.trace.csv.gz"), body, h.get("device", "—"),
        h.get("date", "—"), h.get("commit", "—"), link(SOURCES["replay_default"], doc))


def block_replay_summary(doc):
    rows = replay_rows(read(SOURCES["replay"]))
    g = [ratio(r["gmem_reserved"]) for r in rows]
    p = [ratio(r["pytorch_reserved"]) for r in rows]
    return ("On %d recorded programs (training, serving, generation, two streams), gmem holds "
            "%.3f–%.3f× what live tensors need at their peak, where PyTorch's allocator held "
            "%.3f–%.3f× in the same programs." % (len(rows), min(g), max(g), min(p), max(p)))


# --- gpu-check -------------------------------------------------------------------------------------

MODELS = [  # (label, model, capped)
    ("GPT-2 124M training", "gpt2", False),
    ("ResNet-50 training", "resnet50", False),
    ("Llama-style training, 10 sequence lengths (10 steps in all)", "llama", False),
    ("GPT-2 under a cap of 1.015× its peak", "gpt2", True),
]
ALLOCATORS = [("native", "PyTorch's allocator"), ("expandable", "expandable segments"), ("gmem", "gmem")]


def train_cell(r, total):
    if r is None:
        return "—"
    if r.get("oom"):
        return "out of memory at step %d" % r.get("oom_step", 1) if "oom_step" in r else "out of memory"
    ratio_ = r["peak_reserved"] / r["peak_allocated"]
    time = ("%.2f s" % (r["total_ms"] / 1000)) if total else ("%.1f ms" % r["median_ms"])
    return "%s, %.3f×" % (time, ratio_)


def block_train(doc):
    d = json.loads(read(SOURCES["gpu_json"]))
    txt = read(SOURCES["gpu_txt"])
    m = re.search(r"\bat ([0-9a-f]{7,40})\b", txt.splitlines()[0])
    commit = m.group(1) if m else d.get("commit", "—")[:7]
    out = ["| workload | " + " | ".join(a[1] for a in ALLOCATORS) + " |",
           "| --- | --- | --- | --- |"]
    for label, model, capped in MODELS:
        rows = [r for r in d["train"] if r["model"] == model and bool(r.get("cap_ratio")) == capped]
        cells = []
        for a, _ in ALLOCATORS:
            r = next((r for r in rows if r["allocator"] == a), None)
            cell = train_cell(r, model == "llama")
            cells.append("**%s**" % cell if a == "gmem" else cell)
        out.append("| %s | %s |" % (label, " | ".join(cells)))
    out.append("")
    out.append("Median step (Llama: the 10 timed steps in all) and peak reserved over peak allocated, "
               "%s, torch %s, %s, `scripts/gpu-check` at %s (%s)." % (
                   d["device"], d["torch"], d["date"], commit, link(SOURCES["gpu_txt"], doc)))
    if SOURCES.get("ab"):
        runs = [json.loads(l) for l in read(SOURCES["ab"]).splitlines() if l.startswith("{")]
        runs = [r for r in runs if r["allocator"] == "native" or r.get("page_size") in (None, 2 << 20)]
        parts = []
        for label, model, capped in MODELS:
            of = [r for r in runs if r["model"] == model and bool(r.get("cap_ratio")) == capped]
            if capped or not of:
                continue
            key, unit, scale = ("total_ms", "s", 1000) if model == "llama" else ("median_ms", "ms", 1)
            times = {a: [r[key] / scale for r in of if r["allocator"] == a] for a in ("native", "gmem")}
            fmt = "%.2f" if unit == "s" else "%.1f"
            parts.append("%s: native %s %s, gmem %s %s (gmem / native %.3f in all)" % (
                label.split(" training")[0], ", ".join(fmt % t for t in times["native"]), unit,
                ", ".join(fmt % t for t in times["gmem"]), unit,
                sum(times["gmem"]) / sum(times["native"])))
        out.append("")
        out.append("Alternated on the same GPU right after, one process each (%s): %s." % (
            link(SOURCES["ab"], doc), "; ".join(parts)))
    return "\n".join(out)


def block_gpu_check(doc):
    txt = read(SOURCES["gpu_txt"])
    start = txt.index("== gpu-check")
    lines = txt[start:].splitlines()
    end = next(i for i, l in enumerate(lines) if l.startswith("  llama, gmem's host time"))
    return "```\n%s\n```" % "\n".join(lines[:end + 1])


# --- the OOM report ------------------------------------------------------------------------------


def block_oom(doc):
    text = read(SOURCES["oom"])
    body = "\n".join(l for l in text.splitlines() if not l.startswith("#")).strip("\n")
    return "```\n%s\n```" % body


# --- what fits ----------------------------------------------------------------------------------


def body_of(rel):
    """A recorded result without its `# key: value` header lines."""
    return "\n".join(l for l in read(rel).splitlines() if not l.startswith("#")).strip("\n")


def block_fit(doc):
    h = replay_header(read(SOURCES["fit"]))
    return "```\n%s\n```\n\n(%s, at %s: %s)" % (body_of(SOURCES["fit"]), h.get("device", "—"),
                                               h.get("commit", "—"), link(SOURCES["fit"], doc))


def block_fit_gpt2(doc):
    h = replay_header(read(SOURCES["fit_gpt2"]))
    return "```\n%s\n```\n\n(%s, at %s: %s)" % (body_of(SOURCES["fit_gpt2"]),
                                               h.get("device", "—"), h.get("commit", "—"),
                                               link(SOURCES["fit_gpt2"], doc))


BLOCKS = {
    "fit": block_fit,
    "fit-gpt2": block_fit_gpt2,
    "replay": block_replay,
    "replay-output": block_replay_output,
    "replay-summary": block_replay_summary,
    "train": block_train,
    "gpu-check": block_gpu_check,
    "oom": block_oom,
}


def render(doc, text):
    def sub(m):
        name = m.group(2)
        if name not in BLOCKS:
            raise SystemExit("%s: unknown numbers block %r (known: %s)" % (doc, name, ", ".join(BLOCKS)))
        return m.group(1) + BLOCKS[name](doc).rstrip("\n") + "\n" + m.group(4)
    return BLOCK.sub(sub, text)


def main(argv):
    check = "--check" in argv
    stale = []
    for doc in FILES:
        old = read(doc)
        new = render(doc, old)
        if new == old:
            continue
        if check:
            stale.append(doc)
            sys.stdout.writelines(difflib.unified_diff(old.splitlines(True), new.splitlines(True), doc,
                                                       doc + " (from bench/results)"))
        else:
            with open(os.path.join(ROOT, doc), "w", encoding="utf-8") as f:
                f.write(new)
            print("wrote", doc)
    if stale:
        print("\nout of date: %s; run python3 scripts/readme_numbers.py" % ", ".join(stale))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
