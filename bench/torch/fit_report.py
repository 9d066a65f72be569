"""Tables the JSON lines of fit_bench.py and fit_lightning.py:

    python bench/torch/fit_report.py fit.jsonl
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

GiB = float(1 << 30)


def fit_rows(records):
    head = ("model", "cap", "pick", "true", "steps", "OOMs", "fit s", "pred GiB", "meas GiB",
            "err", "train")
    rows = []
    for r in records:
        fit = r["fit"]
        predicted, measured = fit.get("predicted_peak"), fit.get("measured_peak")
        error = ("%+.2f%%" % (100.0 * (measured - predicted) / predicted)
                 if predicted and measured else "-")
        train = ("%d ok" % r["train_steps"] if not r.get("train_oom")
                 else "OOM at %d" % r["train_steps"]) if "train_steps" in r else "-"
        rows.append((r["model"], "%g" % r["cap_gib"], str(fit["batch_size"]),
                     str(r.get("true_largest")), str(len(fit["steps"])),
                     str(sum(1 for s in fit["steps"] if not s["ok"])), "%.1f" % fit["seconds"],
                     "%.2f" % (predicted / GiB) if predicted else "-",
                     "%.2f" % (measured / GiB) if measured else "-", error, train))
    return head, rows


def lightning_rows(records):
    head = ("finder", "allocator", "cap", "pick", "trials", "OOMs in finder", "finder s",
            "training")
    rows = []
    for r in records:
        training = ("OOM" if r.get("train_oom") else "%d steps ok" % r["global_step"])
        rows.append((r["finder"], r["allocator"], "%g" % r["cap_gib"], str(r["pick"]),
                     str(r.get("trials")), str(r.get("finder_ooms")),
                     "%.1f" % r["finder_seconds"], training))
    return head, rows


def table(head, rows):
    widths = [max(len(str(x)) for x in column) for column in zip(head, *rows)]
    lines = ["  ".join(str(x).rjust(w) for x, w in zip(row, widths)) for row in [head] + rows]
    return "\n".join(lines)


def main():
    if len(sys.argv) != 2:
        raise SystemExit("usage: fit_report.py FILE.jsonl")
    records = common.read_json_lines(sys.argv[1])
    fits = [r for r in records if r.get("bench") == "fit"]
    lightning = [r for r in records if r.get("bench") == "fit_lightning"]
    if not fits and not lightning:
        raise SystemExit("%s: no fit_bench or fit_lightning records" % sys.argv[1])
    if fits:
        print(table(*fit_rows(fits)))
        for r in fits:
            for check in r.get("what_if_checks", []):
                print("what-if %s at cap %g: predicted %.2f GiB, measured %.2f GiB (%+.1f%%)" % (
                    check["setting"], r["cap_gib"], check["predicted_peak"] / GiB,
                    check["measured_peak"] / GiB, 100 * check["error"]))
    if lightning:
        print(table(*lightning_rows(lightning)))


if __name__ == "__main__":
    main()
