#!/usr/bin/env python3
"""docs/ says what holds now, in little space: docs/*.md total under 200 KB; every doc opens with
its title and a short summary of what it answers; no doc names an issue number; and every file
under docs/generated/ is cited by a doc (or README.md) or written by scripts/make_results.sh
(a path there with shell variables matches any file of that shape).

    tests/integration/docs_test.py [ROOT]
"""
import os
import re
import sys

ROOT = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..", "..")
LIMIT = 200_000


def main() -> int:
    failures = []
    docs = sorted(f for f in os.listdir(os.path.join(ROOT, "docs")) if f.endswith(".md"))
    texts = {f: open(os.path.join(ROOT, "docs", f), encoding="utf-8").read() for f in docs}
    total = sum(len(t.encode()) for t in texts.values())
    print(f"docs/*.md: {len(docs)} files, {total} bytes (limit {LIMIT})")
    if total >= LIMIT:
        failures.append(f"docs/*.md total {total} bytes, not under {LIMIT}")
    for f, t in texts.items():
        lines = t.splitlines()
        if not lines or not lines[0].startswith("# "):
            failures.append(f"docs/{f}: does not open with a '# ' title")
            continue
        # The summary: the first non-empty lines after the title, before any heading or table.
        body = [ln for ln in lines[1:12] if ln.strip()]
        if not body or body[0].startswith(("#", "|", "```")):
            failures.append(f"docs/{f}: no summary under its title")
        for n, ln in enumerate(lines, 1):
            if re.search(r"(?<![\w/&])#\d{1,3}\b|\bissues? #?\d{1,3}\b", ln, re.I):
                failures.append(f"docs/{f}:{n}: names an issue: {ln.strip()[:100]}")
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    make = open(os.path.join(ROOT, "scripts", "make_results.sh"), encoding="utf-8").read()
    # A path make_results.sh writes with shell variables ($n, ${n}) matches files of its shape;
    # one that is all variable ("$n.txt") only files whose stem the script names.
    patterns = []
    for m in re.finditer(r"docs/generated/([A-Za-z0-9_.${}\-]+)", make):
        rx = re.sub(r"\\\$\\\{\w+\\\}|\\\$\w+", ".+", re.escape(m.group(1)))
        patterns.append((re.compile(rx + "$"), m.group(1).startswith("$")))

    def written(g: str) -> bool:
        stem = g.rsplit(".", 1)[0]
        return any(p.match(g) and (not bare or re.search(r"\b" + re.escape(stem) + r"\b", make))
                   for p, bare in patterns)

    cited_text = "\n".join(texts.values()) + readme + make
    # name.{txt,json} in a doc cites both.
    cited_text += "\n".join(f"{m.group(1)}.{ext}" for m in re.finditer(r"([\w\-]+)\.\{([\w,]+)\}", cited_text)
                            for ext in m.group(2).split(","))
    gen = sorted(os.listdir(os.path.join(ROOT, "docs", "generated")))
    uncited = [g for g in gen if g not in cited_text and not written(g)]
    print(f"docs/generated: {len(gen)} files, {len(uncited)} cited by nothing")
    failures += [f"docs/generated/{g}: cited by no doc and not written by scripts/make_results.sh"
                 for g in uncited]
    for f in failures:
        print("FAIL", f)
    if not failures:
        print("docs: all checks passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
