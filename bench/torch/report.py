"""Gathers what scripts/gpu-check measured into bench/results/<date>-<device>.json and prints the
short table that ends its output.

    python3 bench/torch/report.py WORK_DIR [--results-dir bench/results]

WORK_DIR holds env.json, steps.tsv, the step logs and alloc/replay/train .jsonl files.
"""

import argparse
import datetime
import json
import os
import re
import shutil

import distributed_bench
from common import REPO, TRACES, read_json_lines

GiB = float(1 << 30)


def read_text(path):
    if not os.path.isfile(path):
        return ""
    with open(path, errors="replace") as f:
        return f.read()


def unittest_counts(log):
    """{ran, failed, skipped, ok} summed over every unittest run in the log (gpu-check runs the
    Python tests in several processes), or None when one never finished."""
    runs = re.findall(r"^Ran (\d+) tests? in [\d.]+s\s*^(OK|FAILED)\b(?: \(([^)]*)\))?", log, re.M)
    started = len(re.findall(r"^Ran \d+ tests?", log, re.M))
    if not runs or len(runs) != started:
        return None
    counts = dict(ran=0, failed=0, skipped=0, ok=True)
    for ran, verdict, details in runs:
        counts["ran"] += int(ran)
        counts["ok"] = counts["ok"] and verdict == "OK"
        for key, value in re.findall(r"(\w+)=(\d+)", details or ""):
            if key in ("failures", "errors"):
                counts["failed"] += int(value)
            elif key == "skipped":
                counts["skipped"] += int(value)
    return counts


def gtest_counts(log):
    passed = re.findall(r"\[  PASSED  \] (\d+) tests?", log)
    failed = re.findall(r"\[  FAILED  \] (\d+) tests?, listed below", log)
    if not passed and not failed:
        return None
    return dict(passed=int(passed[-1]) if passed else 0, failed=int(failed[-1]) if failed else 0)


def read_steps(work):
    steps = []
    for line in read_text(os.path.join(work, "steps.tsv")).splitlines():
        parts = line.split("\t")
        if len(parts) >= 3:
            steps.append(dict(name=parts[0], status=parts[1], seconds=int(parts[2]),
                              detail=parts[3] if len(parts) > 3 else ""))
    return steps


def slug(text):
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "unknown-device"


def build_results(work):
    env = json.loads(read_text(os.path.join(work, "env.json")) or "{}")
    alloc = {}
    for record in read_json_lines(os.path.join(work, "alloc.jsonl")):
        alloc.update(record.get("results", {}))
    return dict(
        date=datetime.date.today().isoformat(),
        device=env.get("device", "unknown"),
        torch=env.get("torch"),
        cuda=env.get("cuda"),
        driver=env.get("driver"),
        commit=env.get("commit"),
        steps=read_steps(work),
        gpu_tests=gtest_counts(read_text(os.path.join(work, "gpu-tests.log"))),
        python_tests=unittest_counts(read_text(os.path.join(work, "python-tests.log"))),
        alloc_ns=alloc,
        replay=read_json_lines(os.path.join(work, "replay.jsonl")),
        train=read_json_lines(os.path.join(work, "train.jsonl")),
        distributed=read_json_lines(os.path.join(work, "distributed.jsonl")),
    )


def fmt(value, spec):
    return format(value, spec) if isinstance(value, (int, float)) else "-"


def table(results):
    out = ["", "== gpu-check: %s | torch %s | %s ==" % (results["device"], results["torch"],
                                                        results["date"])]
    out.append("steps: " + " | ".join("%s %s %ds" % (s["name"], s["status"], s["seconds"])
                                      for s in results["steps"]))
    gpu, py = results["gpu_tests"], results["python_tests"]
    out.append("tests: gmem_gpu_tests %s; tests/python %s" % (
        "%(passed)d passed, %(failed)d failed" % gpu if gpu else "did not run",
        "%(ran)d ran, %(failed)d failed, %(skipped)d skipped" % py if py else "did not finish"))

    alloc = results["alloc_ns"]
    columns = [c for c in ("gmem", "gmem_tracked", "gmem_pystacks", "torch", "torch_expandable",
                           "cudaMallocAsync")
               if c in alloc]
    if columns:
        out.append("")
        out.append("alloc ns          " + "".join("%17s" % c for c in columns))
        for key, label in (("pair_4KiB", "pair 4 KiB"), ("pair_16MiB", "pair 16 MiB"),
                           ("churn", "churn 1000 live")):
            out.append("%-18s" % label + "".join("%17s" % fmt(alloc[c].get(key), ".0f")
                                                 for c in columns))
        # Traces replayed (ns per op, the warmed-up pass): the keys "trace_<name>".
        traces = sorted({k[len("trace_"):] for c in columns for k in alloc[c]
                         if k.startswith("trace_") and not k.endswith("_first_pass")})
        for name in traces:
            out.append("%-18s" % ("trace " + name)[:18] + "".join(
                "%17s" % fmt(alloc[c].get("trace_" + name), ".0f") for c in columns))
        for key, label in (("tracking_overhead", "gmem_tracked"), ("pystacks_overhead", "gmem_pystacks")):
            overhead = alloc.get(key)
            if overhead:
                out.append("tracking: %s / gmem = " % label + ", ".join(
                    "%s %s" % (name, fmt(value, ".3f")) for name, value in overhead.items()))

    replay = {(r["trace"], r["allocator"]): r for r in results["replay"]}
    if replay:
        allocators = ("native", "expandable", "gmem")
        out.append("")
        names = "".join("%8s" % a[:6] for a in allocators)
        out.append("%-26s%9s%s |%9s%s" % ("replay (x peak allocated)", "reserved:", names,
                                          "min cap:", names))
        for trace in TRACES:
            rows = [replay.get((trace, a), {}) for a in allocators]
            out.append("%-26s%9s%s |%9s%s" % (
                trace, "", "".join("%8s" % fmt(r.get("reserved_ratio"), ".3f") for r in rows),
                "", "".join("%8s" % fmt(r.get("min_cap_ratio"), ".3f") for r in rows)))

    out.extend(train_table(results["train"]))
    if results.get("distributed"):
        out.extend(["", "distributed (a rank per GPU, NCCL)",
                    distributed_bench.table(results["distributed"])])
    return "\n".join(out)


TRAIN_ALLOCATORS = ("native", "expandable", "gmem")


def train_cell(r):
    """median ms, reserved / allocated and (gmem) maps after warm-up, or what went wrong."""
    if r is None:
        return "-"
    if "error" in r:
        return "FAILED"
    if r.get("oom"):
        step = r.get("oom_step")
        return "OOM at step %s" % step if step is not None else "OOM at setup"
    maps = r.get("maps_after_warmup")
    return "%7.1f ms %6.3f%s" % (r["median_ms"], r["reserved_ratio"],
                                 " %5s" % maps if maps is not None else "")


def timed_driver_ms(r):
    """gmem's milliseconds in memory calls and in stream waits over the timed steps, or None."""
    if not r or not r.get("step_call_us"):
        return None
    warmup = r.get("warmup", 0)
    return (sum(r["step_call_us"][warmup:]) / 1e3, sum(r["step_wait_us"][warmup:]) / 1e3)


def train_table(records):
    """Models (and capped runs) as rows, allocators side by side."""
    if not records:
        return []
    allocators = [a for a in TRAIN_ALLOCATORS if any(r["allocator"] == a for r in records)]
    allocators += sorted({r["allocator"] for r in records} - set(allocators))
    rows = {}  # (model, cap ratio or None) -> {allocator: record}
    for r in records:
        cap = r.get("cap_ratio") if r.get("cap_bytes") else None
        rows.setdefault((r["model"], cap), {})[r["allocator"]] = r
    out = ["", "train: median step ms, peak reserved / peak allocated, gmem: device maps after warm-up",
           ("%-18s %15s" % ("model", "GiB") + "".join("  %-24s" % a for a in allocators)).rstrip()]
    for (model, cap), runs in rows.items():
        if cap:
            name = "%s cap %gx" % (model, cap)
            some = next(iter(runs.values()))
            size = "cap %.2f" % (some["cap_bytes"] / GiB)
        else:
            name = model
            ok = [r for a, r in sorted(runs.items(), key=lambda kv: kv[0] != "native")
                  if "peak_allocated" in r]
            size = "alloc %.2f" % (ok[0]["peak_allocated"] / GiB) if ok else "-"
        out.append(("%-18s %15s" % (name, size) +
                    "".join("  %-24s" % train_cell(runs.get(a)) for a in allocators)).rstrip())
    for (model, cap), runs in rows.items():  # steps of different shapes: compare the totals
        totals = [(a, runs[a]["total_ms"]) for a in allocators if "total_ms" in runs.get(a, {})]
        varying = any(r.get("varying_steps") for r in runs.values())
        if varying and not cap and totals:
            out.append("  %s, the same lengths in the same order, timed steps in total: %s" % (
                model, ", ".join("%s %.2f s" % (a, ms / 1e3) for a, ms in totals)))
            driver = timed_driver_ms(runs.get("gmem"))
            if driver:
                out.append("  %s, gmem's host time in the driver over its timed steps: %.1f ms in "
                           "memory calls, %.1f ms waiting for streams" % ((model,) + driver))
    for r in records:
        if "error" in r:
            out.append("  %s %s%s failed: %s" % (r["model"], r["allocator"],
                                                 " (capped)" if r.get("cap_bytes") else "",
                                                 r["error"][-100:]))
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("work")
    parser.add_argument("--results-dir", default=os.path.join(REPO, "bench", "results"))
    parser.add_argument("--copy-to", help="also copy the results file into this folder")
    args = parser.parse_args()
    results = build_results(args.work)
    os.makedirs(args.results_dir, exist_ok=True)
    path = os.path.join(args.results_dir, "%s-%s.json" % (results["date"], slug(results["device"])))
    with open(path, "w") as f:
        json.dump(results, f, indent=1, sort_keys=True)
        f.write("\n")
    if args.copy_to:
        shutil.copy(path, args.copy_to)
    print("results: %s" % os.path.relpath(path, REPO))
    print(table(results))


if __name__ == "__main__":
    main()
