"""Opens `gmem report`'s page of each trace in headless Chromium and checks it (scripts/test's
report step; docs/report.md):
  - the page drew (body[data-rendered]) with no console message at all (an error, an uncaught
    exception, a blocked fetch all log one) and no violation of its Content-Security-Policy;
  - no network request: Chromium's NetLog (--log-net-log) holds no request the page started
    (the browser's own background requests, which name no page origin, are not the page's);
  - the numbers on the page equal `gmem summary --json`'s: peak allocated, peak reserved, the cause;
  - by lifetime: each column's lifetimes add up to its sites, and the page draws them;
  - zoomed (#zoom=), the largest-blocks table is the range's peak's;
  - --fit: the batch-size fit's table, with the pick and parts its JSON gives;
  - with --large N: a synthetic trace of N events (make_large_trace.py) gives a page under 10 MB,
    written in under 30 s, drawn in under 2 s.
A screenshot of each page goes to --shots. One line a check: "ok: ..." or "FAILED: ...".

    python3 tests/report/check_reports.py --gmem build/gmem --out DIR [--shots DIR] [--large N] TRACE...
"""

import argparse
import concurrent.futures
import html.parser
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
MAX_PAGE_BYTES = 10 << 20
MAX_WRITE_S = 30.0
MAX_RENDER_MS = 2000


def chromium():
    for name in (os.environ.get("GMEM_CHROMIUM"), "chromium", "chromium-browser", "google-chrome"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


class Dom(html.parser.HTMLParser):
    """The attributes and text of the elements with an id, and the body's attributes."""

    def __init__(self):
        super().__init__()
        self.by_id, self.body, self._open = {}, {}, []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "body":
            self.body = attrs
        if "id" in attrs:
            self.by_id[attrs["id"]] = {"attrs": attrs, "text": ""}
            self._open.append((tag, attrs["id"]))
        else:
            self._open.append((tag, None))

    def handle_endtag(self, tag):
        while self._open:
            t, _ = self._open.pop()
            if t == tag:
                break

    def handle_data(self, data):
        for _, element in self._open:
            if element:
                self.by_id[element]["text"] += data


def page_data(page):
    """The data a report page draws from (its gmem-data script element), as the page reads it."""
    with open(page, encoding="utf-8") as f:
        text = f.read()
    start = text.index('id="gmem-data">') + len('id="gmem-data">')
    return json.loads(text[start:text.index("</script>", start)])


def open_in_chromium(browser, page, work, png=None, hash=""):
    """Loads `page` headless: (DOM after the scripts ran, console lines, page-started requests, s),
    and takes a screenshot into `png` when given."""
    netlog = os.path.join(work, "netlog.json")
    args = [browser, "--headless", "--disable-gpu", "--no-first-run", "--user-data-dir=" + os.path.join(work, "profile"),
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            "--host-resolver-rules=MAP * ~NOTFOUND", "--enable-logging=stderr", "--v=0",
            "--log-net-log=" + netlog, "--hide-scrollbars", "--window-size=1400,2000", "--dump-dom"]
    if png:
        args.append("--screenshot=" + os.path.abspath(png))
    args.append("file://" + os.path.abspath(page) + hash)
    if os.geteuid() == 0:
        args.insert(1, "--no-sandbox")  # Chromium refuses to run as root otherwise
    start = time.monotonic()
    run = subprocess.run(args, capture_output=True, text=True, timeout=120)
    seconds = time.monotonic() - start
    console = [line for line in run.stderr.splitlines() if ":CONSOLE" in line]
    requests = []
    with open(netlog) as f:
        log = json.load(f)
    start_job = log["constants"]["logEventTypes"]["URL_REQUEST_START_JOB"]
    for event in log["events"]:
        params = event.get("params", {})
        # The browser's own (updates, time) carry no initiator; anything the page asked for does.
        if event["type"] == start_job and "url" in params and params.get("initiator") != "not an origin":
            requests.append(params.get("url", "?"))
    return run.stdout, console, requests, seconds


def open_quietly(browser, page, hash=""):
    """Loads `page` headless: (its DOM, the DOM's text, problems), the problems being that it did
    not finish drawing, printed a console line or started a request."""
    with tempfile.TemporaryDirectory() as work:
        dom_text, console, requests, _ = open_in_chromium(browser, page, work, hash=hash)
    dom = Dom()
    dom.feed(dom_text)
    problems = []
    if dom.body.get("data-rendered") != "1":
        problems.append("the page did not finish drawing")
    if console or requests:
        problems.append("console: %s; requests: %s" % (" | ".join(console)[:400], ", ".join(requests)[:200]))
    return dom, dom_text, problems


def check(gmem, browser, trace, out, shots, limits=None):
    """The checks of one trace; returns (name, [problems], note)."""
    name = os.path.basename(trace)
    base = name.replace(".gz", "").replace(".", "_")
    page = os.path.join(out, base + ".html")
    start = time.monotonic()
    made = subprocess.run([gmem, "report", trace, "-o", page], capture_output=True, text=True, timeout=600)
    write_s = time.monotonic() - start
    summary = subprocess.run([gmem, "summary", "--json", trace], capture_output=True, text=True, timeout=600)
    if summary.returncode != 0:
        # A trace with nothing to summarize: the report must refuse it too, with the same reason.
        if made.returncode == 0 or "nothing to report" not in made.stderr:
            return name, ["summary refused it (%s) but report said: %s" % (summary.stderr.strip()[:200],
                                                                         made.stderr.strip()[:300])], ""
        return name, [], "refused, as summary does: " + made.stderr.splitlines()[0][:100]
    if made.returncode != 0:
        return name, ["gmem report failed: " + made.stderr.strip()[:500]], ""
    expected = json.loads(summary.stdout)
    problems = []
    with tempfile.TemporaryDirectory() as work:
        png = os.path.join(shots, base + ".png") if shots else None
        dom_text, console, requests, load_s = open_in_chromium(browser, page, work, png)
        dom = Dom()
        dom.feed(dom_text)
        if dom.body.get("data-rendered") != "1":
            problems.append("the page did not finish drawing (no body[data-rendered])")
        if console:
            problems.append("console: " + " | ".join(console)[:600])
        if dom.body.get("data-csp-violations"):
            problems.append("%s fetches blocked by the page's policy" % dom.body["data-csp-violations"])
        if requests:
            problems.append("network requests: " + ", ".join(requests)[:300])
        stats = expected["stats"]
        for element, key in (("peak-allocated", "allocated_bytes.all.peak"), ("peak-reserved", "reserved_bytes.all.peak")):
            shown = dom.by_id.get(element, {}).get("attrs", {}).get("data-bytes")
            if shown != str(stats[key]):
                problems.append("%s: the page shows %s, gmem summary --json %s" % (element, shown, stats[key]))
        cause = dom.by_id.get("cause", {}).get("text", "").strip()
        if cause != expected["cause"]:
            problems.append("cause: the page says %r, gmem summary --json %r" % (cause, expected["cause"]))
        if png and not os.path.isfile(png):
            problems.append("no screenshot written")
    render_ms = int(dom.body.get("data-render-ms", "-1"))
    note = "%.2f s to write, %d KiB, drawn in %d ms (%.1f s with Chromium's start)" % (
        write_s, os.path.getsize(page) >> 10, render_ms, load_s)
    if limits:
        if os.path.getsize(page) > MAX_PAGE_BYTES:
            problems.append("page of %d bytes, over %d" % (os.path.getsize(page), MAX_PAGE_BYTES))
        if write_s > MAX_WRITE_S:
            problems.append("written in %.1f s, over %.0f s" % (write_s, MAX_WRITE_S))
        if not 0 <= render_ms <= MAX_RENDER_MS:
            problems.append("drawn in %d ms, over %d ms" % (render_ms, MAX_RENDER_MS))
    return name, problems, note


def check_png(gmem, traces, out):
    """--png writes a PNG through Chromium; with no Chromium it says so and how to get one."""
    traces = [t for t in traces if "leak" in os.path.basename(t)] or traces
    if not traces:
        return 0
    failed = 0
    page, png = os.path.join(out, "png_check.html"), os.path.join(out, "png_check.png")
    made = subprocess.run([gmem, "report", traces[0], "-o", page, "--png", png], capture_output=True, text=True,
                          timeout=300)
    with open(png, "rb") if os.path.isfile(png) else open(os.devnull, "rb") as f:
        magic = f.read(8)
    if made.returncode != 0 or magic != b"\x89PNG\r\n\x1a\n":
        print("FAILED: --png: status %d, %r: %s" % (made.returncode, magic, made.stderr.strip()[:300]))
        failed += 1
    else:
        print("ok: --png wrote a PNG of %d KiB" % (os.path.getsize(png) >> 10))
    env = {k: v for k, v in os.environ.items() if k != "GMEM_CHROMIUM"}
    env["PATH"] = os.path.join(out, "no-such-dir")
    made = subprocess.run([os.path.abspath(gmem), "report", traces[0], "-o", page, "--png", png], capture_output=True,
                          text=True, timeout=300, env=env)
    if made.returncode == 0 or "apt-get install chromium" not in made.stderr or not os.path.isfile(page):
        print("FAILED: --png without Chromium: status %d: %s" % (made.returncode, made.stderr.strip()[:300]))
        failed += 1
    else:
        print("ok: --png without Chromium says how to get it, and the HTML is written")
    return failed


def check_compare(gmem, browser, first, second, out):
    """Two traces on one page: it draws, quietly and offline, with the second run's headline."""
    name = "%s vs %s" % (os.path.basename(first), os.path.basename(second))
    page = os.path.join(out, "compare.html")
    made = subprocess.run([gmem, "report", first, second, "-o", page], capture_output=True, text=True, timeout=600)
    if made.returncode != 0:
        return name, ["gmem report A B failed: " + made.stderr.strip()[:300]]
    expected = json.loads(subprocess.run([gmem, "summary", "--json", second], capture_output=True, text=True,
                                         timeout=600).stdout)
    dom, _, problems = open_quietly(browser, page)
    shown = dom.by_id.get("compare-peak-allocated", {}).get("attrs", {}).get("data-bytes")
    if shown != str(expected["stats"]["allocated_bytes.all.peak"]):
        problems.append("the second run's peak allocated: page %s, summary %s" % (
            shown, expected["stats"]["allocated_bytes.all.peak"]))
    if "site-diff" not in dom.by_id:
        problems.append("no site-by-site table")
    return name, problems


def check_ranks(gmem, browser, traces, out):
    """--ranks: the page's peak rank and imbalance equal `gmem summary --ranks --json`'s."""
    page = os.path.join(out, "ranks.html")
    made = subprocess.run([gmem, "report", "--ranks"] + traces + ["-o", page], capture_output=True, text=True,
                          timeout=600)
    if made.returncode != 0:
        return ["gmem report --ranks failed: " + made.stderr.strip()[:300]]
    expected = json.loads(subprocess.run([gmem, "summary", "--ranks", "--json"] + traces, capture_output=True,
                                         text=True, timeout=600).stdout)
    dom, _, problems = open_quietly(browser, page)
    shown = dom.by_id.get("imbalance", {}).get("attrs", {})
    if shown.get("data-peak-rank") != str(expected["peak_rank"]):
        problems.append("peak rank: page %s, summary %s" % (shown.get("data-peak-rank"), expected["peak_rank"]))
    if abs(float(shown.get("data-imbalance", "nan")) - expected["imbalance"]) > 1e-4:
        problems.append("imbalance: page %s, summary %s" % (shown.get("data-imbalance"), expected["imbalance"]))
    return problems


# A torch fit's as_dict() (saved_per_sample set), as gmem.fit_batch_size returns it.
FIT = {"batch_size": 48, "budget": 80 << 30, "limit": 80 << 30, "device_total": 80 << 30, "held_outside": 512 << 20,
       "resident": 3 << 30, "step_fixed": 1 << 30, "per_sample": 1500 << 20, "saved_per_sample": 1200 << 20,
       "overhead": 200 << 20, "predicted_peak": (4 << 30) + 48 * (1500 << 20),
       "measured_peak": (4 << 30) + 48 * (1500 << 20) + (30 << 20), "measured_reserved": None, "affine": True,
       "method": "predicted", "upper_bound": None, "notes": ["a <note> & more"], "seconds": 12.5, "ranks": 1,
       "fixed": 4 << 30,
       "steps": [{"batch_size": b, "kind": k, "ok": ok, "peak_allocated": (4 << 30) + b * (1500 << 20) if ok else 0}
                 for b, k, ok in ((1, "probe", True), (2, "probe", True), (24, "probe", True), (48, "verify", True))]}


def check_fit(gmem, browser, trace, out):
    """--fit: the fit's table draws quietly, with the pick and the parts as the JSON has them."""
    fit_json, page = os.path.join(out, "fit.json"), os.path.join(out, "fit.html")
    with open(fit_json, "w") as f:
        json.dump(FIT, f)
    made = subprocess.run([gmem, "report", trace, "-o", page, "--fit", fit_json], capture_output=True, text=True,
                          timeout=300)
    if made.returncode != 0:
        return ["gmem report --fit failed: " + made.stderr.strip()[:300]]
    dom, dom_text, problems = open_quietly(browser, page)
    pick = dom.by_id.get("fit-pick", {}).get("attrs", {})
    if pick.get("data-batch-size") != "48" or pick.get("data-budget") != str(FIT["budget"]):
        problems.append("the pick: page %s" % pick)
    for element, name in (("fit-saved", "saved for backward"), ("fit-temporaries", "temporaries at the peak")):
        if name not in dom.by_id.get(element, {}).get("text", ""):
            problems.append("no %r row" % name)
    if "a <note> & more" not in dom_text.replace("&lt;", "<").replace("&gt;", ">").replace("&amp;", "&"):
        problems.append("the note is not on the page as written")
    return problems


def check_lifetimes(gmem, browser, trace, out):
    """Allocated memory by lifetime: in every column the lifetimes add up to what the sites do
    (both stacks are taken at the column's highest point), and the page draws it (#stack=lifetime)."""
    page = os.path.join(out, "lifetimes.html")
    made = subprocess.run([gmem, "report", trace, "-o", page], capture_output=True, text=True, timeout=300)
    if made.returncode != 0:
        return ["gmem report failed: " + made.stderr.strip()[:300]]
    data = page_data(page)
    problems = []
    if not data.get("lifetime_names"):
        return ["no lifetimes in a trace with %d steps" % data["steps"]["count"]]
    for name, axis in data["axes"].items():
        for c in range(len(axis["sites_x"])):
            by_site = sum(values[c] for values in axis["sites"])
            by_life = sum(values[c] for values in axis["lifetimes"])
            if by_site != by_life:
                problems.append("%s axis, column %d: by site %d, by lifetime %d" % (name, c, by_site, by_life))
                break
    dom, _, drawn = open_quietly(browser, page, hash="#stack=lifetime")
    problems += drawn
    if dom.by_id.get("stack-title", {}).get("text") != "Allocated memory by lifetime":
        problems.append("#stack=lifetime: the title reads %r" % dom.by_id.get("stack-title", {}).get("text"))
    if "kept across steps" not in dom.by_id.get("sites", {}).get("text", ""):
        problems.append("the lifetime table has no 'kept across steps' row")
    return problems


def check_zoom(gmem, browser, trace, out):
    """Zoomed into the first half (#zoom=, x: events), the largest-blocks table shows the blocks live
    at the range's peak, as the page's data gives them, not those at the trace's peak."""
    page = os.path.join(out, "zoom.html")
    made = subprocess.run([gmem, "report", trace, "-o", page, "--axis", "events"], capture_output=True, text=True,
                          timeout=300)
    if made.returncode != 0:
        return ["gmem report failed: " + made.stderr.strip()[:300]]
    data = page_data(page)
    axis = data["axes"]["event"]
    lo, hi = 0.0, axis["sites_x"][-1] / 2
    # As the page finds the range's peak: the first column of the highest stacked total.
    columns = [c for c, x in enumerate(axis["sites_x"]) if lo <= x <= hi]
    totals = [sum(values[c] for values in axis["sites"]) for c in columns]
    peak_column = columns[totals.index(max(totals))]
    applied = axis["peak_applied"][peak_column]
    live = [b for b in data["blocks"]["list"] if b[1] < applied and b[2] >= applied][:25]
    problems = []
    if not live or {b[1] for b in live} == {b["event"] for b in data["largest"]["blocks"]}:
        problems.append("the first half's largest blocks are the trace's: a poor range for this check")
    dom, _, drawn = open_quietly(browser, page, hash="#x=event&zoom=%r,%r" % (lo, hi))
    problems += drawn
    if dom.by_id.get("largest-title", {}).get("text") != "Largest live blocks at the range's peak":
        problems.append("the title reads %r" % dom.by_id.get("largest-title", {}).get("text"))
    table = dom.by_id.get("largest", {}).get("text", "")
    if "the %d largest blocks then live" % len(live) not in table:
        problems.append("expected %d blocks: %r" % (len(live), table[:200]))
    shown = [b for b in live if "0x%x" % b[3] in table]
    if len(shown) != len(live):
        problems.append("%d of the %d blocks live at the range's peak are in the table" % (len(shown), len(live)))
    return problems


def main(argv):
    p = argparse.ArgumentParser()
    p.add_argument("--gmem", required=True)
    p.add_argument("--out", required=True, help="where the pages go")
    p.add_argument("--shots", help="where screenshots go")
    p.add_argument("--large", type=int, default=0, help="events in a synthetic trace to check for scale")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("traces", nargs="*")
    a = p.parse_args(argv)
    browser = chromium()
    if browser is None:
        print("skipped: no headless Chromium (chromium, chromium-browser or google-chrome on PATH, or "
              "$GMEM_CHROMIUM); Debian: apt-get install chromium (.ci/run installs it)")
        return 0
    os.makedirs(a.out, exist_ok=True)
    if a.shots:
        os.makedirs(a.shots, exist_ok=True)
    failed = 0
    jobs = [(t, False) for t in a.traces]
    if a.large:
        large = os.path.join(a.out, "large.trace.csv.gz")
        subprocess.run([sys.executable, os.path.join(HERE, "make_large_trace.py"), large, str(a.large)],
                       check=True, stdout=subprocess.DEVNULL)
        jobs.append((large, True))
    failed += check_png(a.gmem, a.traces, a.out)
    pair = [t for t in a.traces if os.path.basename(t).startswith("gpt2")][:2]
    if len(pair) == 2:
        name, problems = check_compare(a.gmem, browser, pair[0], pair[1], a.out)
        failed += 1 if problems else 0
        print(("FAILED: %s: %s" % (name, "; ".join(problems))) if problems else "ok: %s on one page" % name)
    ranks = [t for t in a.traces if os.path.basename(t).startswith("gpt2")][:3]
    if len(ranks) >= 2:
        problems = check_ranks(a.gmem, browser, ranks, a.out)
        failed += 1 if problems else 0
        print(("FAILED: --ranks: " + "; ".join(problems)) if problems else
              "ok: --ranks of %d traces: the peak rank and the imbalance are gmem summary --ranks's" % len(ranks))
    if a.traces:
        problems = check_fit(a.gmem, browser, a.traces[0], a.out)
        failed += 1 if problems else 0
        print(("FAILED: --fit: " + "; ".join(problems)) if problems else
              "ok: --fit: the batch-size fit's table, as its JSON gives it")
    leaky = [t for t in a.traces if os.path.basename(t).startswith("leak_losses")]
    if leaky:
        problems = check_lifetimes(a.gmem, browser, leaky[0], a.out)
        failed += 1 if problems else 0
        print(("FAILED: by lifetime: " + "; ".join(problems)) if problems else
              "ok: by lifetime: in every column the lifetimes add up to the sites, and the page draws them")
        problems = check_zoom(a.gmem, browser, leaky[0], a.out)
        failed += 1 if problems else 0
        print(("FAILED: zoomed largest blocks: " + "; ".join(problems)) if problems else
              "ok: zoomed, the largest-blocks table shows the blocks live at the range's peak")
    with concurrent.futures.ThreadPoolExecutor(max(1, a.jobs)) as pool:
        futures = [pool.submit(check, a.gmem, browser, t, a.out, a.shots, large) for t, large in jobs]
        for f in futures:
            try:
                name, problems, note = f.result()
            except Exception as e:  # a timeout, a crash: one failed check, the others go on
                name, problems, note = "?", ["%s: %s" % (type(e).__name__, e)], ""
            if problems:
                failed += 1
                print("FAILED: %s: %s" % (name, "; ".join(problems)))
            else:
                print("ok: %s: %s" % (name, note))
            sys.stdout.flush()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
