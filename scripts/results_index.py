#!/usr/bin/env python3
"""Writes bench/results/README.md: one line per result file, giving its date, the device, the
commit and what it measures, read from the file's name and contents ("—" where the file does not
say).

    python3 scripts/results_index.py           rewrite bench/results/README.md
    python3 scripts/results_index.py --check   exit 1 if it is out of date (tests/python/test_docs.py)

Where the fields come from:
- date: the file name's leading YYYY-MM-DD;
- device: the name's device part (nvidia-h100-80gb-hbm3, nvidia-h200, nvidia-h200-x2, vm), or a
  `# device:` header line;
- commit: a `# commit:` header line, else "at <hash>" in the file's first lines (what the person who
  ran it wrote), else the JSON's "commit" field (gpu-check's JSON records the device copy's git
  metadata, which was stale in some runs);
- what: a `# what:` header line, else the file's first line where it is prose, else what its
  records hold (gpu-check's steps, or the models and allocators of JSON lines), else the name.
Standard library only.
"""
import json
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results")
INDEX = os.path.join(RESULTS, "README.md")

NAME = re.compile(r"^(\d{4}-\d\d-\d\d)-(?:(nvidia-h100-80gb-hbm3|nvidia-h200-x2|nvidia-h200|vm)(?:-|(?=\.)))?(.*?)\.([a-z]+)$")
DEVICES = {
    "nvidia-h100-80gb-hbm3": "NVIDIA H100 80GB HBM3",
    "nvidia-h200": "NVIDIA H200",
    "nvidia-h200-x2": "2× NVIDIA H200",
    "vm": "VM (simulated device)",
}
HASH = re.compile(r"\bat ([0-9a-f]{7,40})\b")


def head(path, n=4000):
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read(n)


def headers(text):
    return dict(re.findall(r"^# (device|commit|what|date|command): (.*)$", text, re.M))


def short(s, n=150):
    s = " ".join(s.split()).rstrip(".:;,")
    return s if len(s) <= n else s[: n - 1].rsplit(" ", 1)[0] + " …"


def jsonl_records(path, limit=400):
    out = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for i, line in enumerate(f):
            if i >= limit:
                break
            line = line.strip()
            if line.startswith("{"):
                try:
                    out.append(json.loads(line))
                except ValueError:
                    pass
    return out


def describe_records(recs):
    models = sorted({str(r.get("model") or r.get("program") or os.path.basename(str(r.get("trace"))))
                     for r in recs if r.get("model") or r.get("program") or r.get("trace")})
    models = [m for m in models if not m.endswith(".gz")] or models
    allocs = sorted({str(r["allocator"]) for r in recs if r.get("allocator")})
    kinds = sorted({str(r["kind"]) for r in recs if r.get("kind")})
    parts = []
    if kinds:
        parts.append("/".join(kinds))
    if models:
        parts.append(", ".join(models[:8]) + (" and %d more" % (len(models) - 8) if len(models) > 8 else ""))
    if allocs:
        parts.append("under " + ", ".join(allocs))
    return " ".join(parts)


def entry(name):
    m = NAME.match(name)
    path = os.path.join(RESULTS, name)
    date, dev, rest, ext = (m.group(1), m.group(2), m.group(3), m.group(4)) if m else ("—", None, name, "")
    text = head(path)
    h = headers(text)
    device = h.get("device") or DEVICES.get(dev, "—")
    commit = h.get("commit")
    what = h.get("what")
    first = next((l for l in text.splitlines() if l.strip()), "")
    if not commit:
        hm = HASH.search("\n".join(text.splitlines()[:6]))
        commit = hm.group(1) if hm else None
    if ext == "json":
        try:
            with open(path, encoding="utf-8") as f:
                d = json.load(f)
        except ValueError:
            d = None
        if isinstance(d, dict):
            device = d.get("device", device) if device == "—" or dev is None else device
            if not commit and re.match(r"^[0-9a-f]{7,40}$", str(d.get("commit", ""))):
                commit = str(d["commit"])[:7]
            if not what and "train" in d and "steps" in d:
                steps = ", ".join(s["name"] for s in d["steps"] if s.get("status") == "ok")
                what = "scripts/gpu-check results (JSON): " + (steps or "no step ok")
    elif ext == "jsonl":
        recs = jsonl_records(path)
        commit = commit or next((str(r["commit"])[:7] for r in recs if r.get("commit")), None)
        if not what:
            what = describe_records(recs)
            what = "JSON lines: " + what if what else None
    elif ext == "patch":
        files = sorted(set(re.findall(r"^\+\+\+ b/(\S+)", head(path, 10 ** 6), re.M)))
        what = what or "a patch (tried, not kept) to " + ", ".join(files)
    if not what and ext == "txt":
        prose = first and not first.startswith(("[", "{", "==", "diff ", "results:")) \
            and not re.match(r"^\S+\s{2,}\S", first)
        if "== gpu-check" in head(path, 10 ** 6):
            what = "scripts/gpu-check output" + (": " + first.lstrip("# ") if prose else "")
        elif prose:
            what = first.lstrip("# ")
    label = rest.replace("-", " ").strip() if rest else ""
    if not what:
        what = label or "—"
    elif label and label.lower() not in what.lower():
        what = "%s: %s" % (label, what)
    return date, device, (commit or "—")[:7] if commit else "—", short(what)


def render():
    names = sorted(n for n in os.listdir(RESULTS) if n != "README.md" and not n.startswith("."))
    lines = [
        "# Result files",
        "",
        "One line per file in `bench/results/`: its date, the device it ran on, the commit, and what it",
        "measures. Generated by `scripts/results_index.py` from the files' names and contents; do not edit",
        "by hand (`tests/python/test_docs.py` checks that it is current). \"—\" means the file does not say.",
        "A `.json` and a `.txt` of the same name are one run: the JSON has the numbers, the text what was",
        "printed. Where each result is discussed: [the notebook](../../docs/notes/README.md) and",
        "[docs/benchmarks.md](../../docs/benchmarks.md). Runs superseded by later runs of the same",
        "measurement and cited nowhere were removed; git history keeps them.",
        "",
        "| file | date | device | commit | what it measures |",
        "| --- | --- | --- | --- | --- |",
    ]
    for n in names:
        date, device, commit, what = entry(n)
        lines.append("| [%s](%s) | %s | %s | %s | %s |" % (n, n, date, device, commit, what.replace("|", "\\|")))
    return "\n".join(lines) + "\n"


def main(argv):
    new = render()
    old = open(INDEX, encoding="utf-8").read() if os.path.exists(INDEX) else ""
    if "--check" in argv:
        if new != old:
            print("bench/results/README.md is out of date: run python3 scripts/results_index.py")
            return 1
        return 0
    if new != old:
        with open(INDEX, "w", encoding="utf-8") as f:
            f.write(new)
        print("wrote bench/results/README.md (%d files)" % (new.count("\n| [")))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
