"""The docs hold together: every relative link and #anchor in README.md, docs/, python/README.md
and bench/ resolves; README's numbers are those of bench/results (scripts/readme_numbers.py);
bench/results/README.md indexes every result file (scripts/results_index.py).

Standard library only, run by scripts/test's python step:
    python3 -m unittest discover -s tests/python -k test_docs
"""
import importlib.util
import os
import re
import subprocess
import sys
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Docs that README links to and other changes write. A link to one is checked once the file exists.
PENDING = set()

FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.S | re.M)
CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"(?<!!)\[(?:[^\]\n]|\n(?!\n))*?\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$", re.M)
HTML_ID = re.compile(r"<a\s+(?:id|name)=\"([^\"]+)\"", re.I)


def markdown_files():
    out = ["README.md", "python/README.md"]
    for top in ("docs", "bench"):
        for dirpath, _, names in os.walk(os.path.join(ROOT, top)):
            out += [os.path.relpath(os.path.join(dirpath, n), ROOT) for n in names if n.endswith(".md")]
    return sorted(p for p in set(out) if os.path.exists(os.path.join(ROOT, p)))


def slug(heading):
    """GitHub's anchor for a heading: lower case, inline markup dropped, punctuation other than
    '-' and '_' dropped, spaces to '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").replace("*", "")
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path, cache={}):
    if path not in cache:
        with open(path, encoding="utf-8") as f:
            text = FENCE.sub("", f.read())
        seen, found = {}, set()
        for m in HEADING.finditer(text):
            s = slug(m.group(2))
            n = seen.get(s, 0)
            seen[s] = n + 1
            found.add(s if n == 0 else "%s-%d" % (s, n))
        found.update(HTML_ID.findall(text))
        cache[path] = found
    return cache[path]


def links(path):
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        text = f.read()
    text = CODE.sub("", FENCE.sub("", text))
    return [m.group(1) for m in LINK.finditer(text)]


class DocLinksTest(unittest.TestCase):
    def test_relative_links_and_anchors_resolve(self):
        broken = []
        files = markdown_files()
        self.assertIn("README.md", files)
        self.assertTrue(any(f.startswith("docs/notes/") for f in files), files)
        for doc in files:
            base = os.path.dirname(os.path.join(ROOT, doc))
            for target in links(doc):
                if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:
                    continue
                path, _, anchor = target.partition("#")
                full = os.path.normpath(os.path.join(base, path)) if path else os.path.join(ROOT, doc)
                rel = os.path.relpath(full, ROOT)
                if not os.path.exists(full):
                    if rel not in PENDING:
                        broken.append("%s: %s (no such file)" % (doc, target))
                    continue
                if anchor and full.endswith(".md") and anchor not in anchors(full):
                    broken.append("%s: %s (no heading or anchor '%s' in %s)" % (doc, target, anchor, rel))
        self.assertEqual(broken, [], "\n" + "\n".join(broken))

    def test_slug_matches_github(self):
        self.assertEqual(slug("Several GPUs (torch.distributed)"), "several-gpus-torchdistributed")
        self.assertEqual(slug("`gmem replay`: what PyTorch reserved, what gmem needs"),
                         "gmem-replay-what-pytorch-reserved-what-gmem-needs")
        self.assertEqual(slug("What fits: the largest batch"), "what-fits-the-largest-batch")


def load_script(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "scripts", name + ".py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class ReadmeNumbersTest(unittest.TestCase):
    def run_script(self, name, *args):
        return subprocess.run([sys.executable, os.path.join(ROOT, "scripts", name)] + list(args),
                              capture_output=True, text=True, cwd=ROOT)

    def test_readme_numbers_are_current(self):
        r = self.run_script("readme_numbers.py", "--check")
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)

    def test_check_finds_a_number_changed_by_hand(self):
        numbers = load_script("readme_numbers")
        with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
            readme = f.read()
        blocks = numbers.BLOCK.findall(readme)
        self.assertGreaterEqual(len(blocks), 3, "README has generated blocks")
        self.assertEqual(numbers.render("README.md", readme), readme)
        edited = re.sub(r"\d\.\d{3}", "9.999", readme, count=1)
        self.assertNotEqual(edited, readme)
        self.assertEqual(numbers.render("README.md", edited), readme, "rendering restores the numbers")

    def test_unknown_block_is_an_error(self):
        numbers = load_script("readme_numbers")
        with self.assertRaises(SystemExit):
            numbers.render("x.md", "<!-- numbers:nope -->\n<!-- /numbers -->\n")

    def test_results_index_is_current(self):
        r = self.run_script("results_index.py", "--check")
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)

    def test_every_result_file_is_indexed(self):
        index = open(os.path.join(ROOT, "bench", "results", "README.md"), encoding="utf-8").read()
        for name in os.listdir(os.path.join(ROOT, "bench", "results")):
            if name != "README.md":
                self.assertIn("[%s](%s)" % (name, name), index)


if __name__ == "__main__":
    unittest.main()
