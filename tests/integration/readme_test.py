#!/usr/bin/env python3
"""README.md as a fresh clone reads it: under 10,000 bytes, every relative link names a file of the
checkout (no #anchor), every repository path named in a code block exists, and every script the
README names exists, is executable and answers `--help` (exit 0, some output) without building or
installing anything.

  python3 tests/integration/readme_test.py
"""
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from script_checks import ROOT, Checks  # noqa: E402

MAX_BYTES = 10_000
# Top-level folders of the checkout whose paths a code block may name (build/ is made by the build).
TREE = ("scripts", "integration", "docs", "tests", "runtime", "plugin", "collectives", "bench",
        "cmake")
PATH_RE = re.compile(r"(?<![\w./-])((?:%s)/[\w./-]*[\w/])" % "|".join(TREE))
SCRIPT_RE = re.compile(r"(?<![\w./-])(scripts/[\w./-]*[\w])")
LINK_RE = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")

checks = Checks()
check = checks.check


def code_blocks(text):
    """The fenced code blocks' bodies, in order."""
    return re.findall(r"^```[^\n]*\n(.*?)^```", text, flags=re.S | re.M)


def answers_help(path):
    """(ok, detail): PATH --help exits 0 and prints something, in a scratch HOME and working
    directory, so that a script that wrongly built or installed would not touch the user's."""
    with tempfile.TemporaryDirectory() as home:
        env = dict(os.environ, HOME=home)
        try:
            r = subprocess.run([path, "--help"], cwd=home, env=env, capture_output=True,
                               text=True, timeout=30)
        except subprocess.TimeoutExpired:
            return False, "no answer in 30 s"
        except OSError as e:
            return False, str(e)
    out = (r.stdout + r.stderr).strip()
    return r.returncode == 0 and bool(out), f"exit {r.returncode}, {len(out)} characters"


def main():
    with open(os.path.join(ROOT, "README.md"), "rb") as f:
        raw = f.read()
    text = raw.decode("utf-8")
    check("README.md is under 10,000 bytes", len(raw) < MAX_BYTES, f"{len(raw)} bytes")

    links = sorted({u for u in LINK_RE.findall(text) if not re.match(r"[a-z]+:", u)})
    check("README.md has relative links", bool(links), f"{len(links)}")
    for url in links:
        check(f"link {url} names a file of the checkout, without an anchor",
              "#" not in url and os.path.exists(os.path.join(ROOT, url)))

    blocks = code_blocks(text)
    check("README.md has code blocks", len(blocks) >= 3, f"{len(blocks)}")
    named = sorted({p.rstrip("/") for b in blocks for p in PATH_RE.findall(b)})
    for p in named:
        check(f"{p} (named in a code block) exists", os.path.exists(os.path.join(ROOT, p)))

    scripts = sorted({s for s in SCRIPT_RE.findall(text) if not s.endswith(".md")})
    check("README.md names scripts/run.sh and scripts/test.sh",
          {"scripts/run.sh", "scripts/test.sh"} <= set(scripts), ", ".join(scripts))
    for s in scripts:
        path = os.path.join(ROOT, s)
        if not os.path.isfile(path):
            check(f"{s} exists", False)
            continue
        if not os.access(path, os.X_OK):
            check(f"{s} is executable", False)
            continue
        check(f"{s} is executable", True)
        ok, detail = answers_help(path)
        check(f"{s} --help", ok, detail)
    checks.finish()


if __name__ == "__main__":
    main()
