#!/usr/bin/env python3
"""Every command the docs mark as runnable, run as written against a fresh build.

A fenced block whose info string is `sh runnable` (in README.md, deploy/README.md and
docs/*.md) is run as one bash script (`set -euo pipefail`): each command must parse and exit 0
within 60 s (`sh runnable exit=N`: the block ends with exit N, as an audit that finds an error
does). Blocks of plain `sh` are shown, not run: they start servers on fixed ports, talk to
services that are not here, or take minutes. The commands run with `stormguard` on the PATH (the
binary given, a fresh debug build), in a scratch directory whose `crates`, `deploy`, `docs` and
`tests` are the repository's (so `deploy/examples/...` resolves, and what a command writes —
`report.html`, `my.toml` — lands in the scratch directory). Nothing listens: the runnable
commands read files and print.

Usage: python3 scripts/doc-commands.py PATH/TO/stormguard [FILE.md ...]
(the files given instead of the docs: scripts/test runs it on tests/doc-commands/broken.md too,
which must fail). Exit 0 when every runnable block passes, 1 naming each one that did not
(file, line, its output); prints each block's time.
"""

import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT = 60


def blocks(path):
    """The runnable blocks of one Markdown file: (line of the fence, the block's text, the exit
    status it ends with)."""
    out = []
    lines = open(path, encoding="utf-8").read().split("\n")
    i = 0
    while i < len(lines):
        fence = re.match(r"^(`{3,})(.*)$", lines[i])
        if fence:
            ticks, info = fence.group(1), fence.group(2).split()
            j = i + 1
            while j < len(lines) and not lines[j].startswith(ticks):
                j += 1
            if info[:2] == ["sh", "runnable"]:
                expect = 0
                for word in info[2:]:
                    if not word.startswith("exit="):
                        raise SystemExit(f"{path}:{i + 1}: unknown word {word!r} after `sh runnable`")
                    expect = int(word.removeprefix("exit="))
                out.append((i + 1, "\n".join(lines[i + 1:j]), expect))
            i = j
        i += 1
    return out


def main():
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    binary = os.path.abspath(sys.argv[1])
    if not os.access(binary, os.X_OK):
        raise SystemExit(f"{binary}: not an executable")
    files = sys.argv[2:] or (
        ["README.md", "deploy/README.md"] + sorted(glob.glob("docs/*.md", root_dir=ROOT))
    )
    scratch = tempfile.mkdtemp(prefix="stormguard-doc-commands-")
    failures, ran = [], 0
    try:
        bin_dir = os.path.join(scratch, "bin")
        os.mkdir(bin_dir)
        os.symlink(binary, os.path.join(bin_dir, "stormguard"))
        for d in ["crates", "deploy", "docs", "tests"]:
            os.symlink(os.path.join(ROOT, d), os.path.join(scratch, d))
        env = dict(os.environ, PATH=bin_dir + os.pathsep + os.environ.get("PATH", ""))
        env.pop("STORMGUARD_LOG", None)
        for f in files:
            for line, text, expect in blocks(os.path.join(ROOT, f)):
                ran += 1
                started = time.monotonic()
                try:
                    p = subprocess.run(
                        ["bash", "-c", "set -euo pipefail\n" + text], cwd=scratch, env=env,
                        capture_output=True, text=True, timeout=TIMEOUT,
                    )
                    code, output = p.returncode, (p.stdout + p.stderr)
                except subprocess.TimeoutExpired:
                    code, output = None, f"still running after {TIMEOUT} s"
                took = time.monotonic() - started
                first = text.strip().splitlines()[0] if text.strip() else "(empty)"
                print(f"{f}:{line}: {'ok' if code == expect else 'FAILED'} ({took:.1f}s)  {first}")
                if code != expect:
                    tail = "\n".join(output.strip().splitlines()[-15:])
                    failures.append(
                        f"{f}:{line}: exit {code}, expected {expect}:\n{text}\n--- output ---\n{tail}"
                    )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if ran == 0:
        failures.append("no block is marked `sh runnable`: the check checks nothing")
    if failures:
        print("\n\n".join(failures), file=sys.stderr)
        sys.exit(1)
    print(f"every runnable command in the docs ran ({ran} blocks)")


if __name__ == "__main__":
    main()
