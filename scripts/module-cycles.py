#!/usr/bin/env python3
"""Fails when the top-level modules of a crate import each other in a circle.

A module's dependencies are the `crate::<module>` paths in its code (its file and, for a module
with a directory, every file under it), outside comments and outside a `#[cfg(test)] mod` (or
`#[cfg(all(test, …))] mod`) block; `lib.rs` and `main.rs` are the root and may name anything.
A circle is a chain of modules that leads back to where it started.

Usage: scripts/module-cycles.py CRATE_SRC_DIR...   (exit 1 when any has a circle)
"""

import glob
import os
import re
import sys

PATH = re.compile(r"crate::([a-z_][a-z0-9_]*)")
TESTS = re.compile(r"#\[cfg\((?:test|all\(test[^\]]*)\)\]\s*mod ")


def code(path):
    """A file's text without its test module and without comment lines."""
    text = TESTS.split(open(path, encoding="utf-8").read())[0]
    return "\n".join(l for l in text.splitlines() if not l.strip().startswith("//"))


def modules(src):
    deps = {}
    for f in glob.glob(os.path.join(src, "*.rs")):
        name = os.path.basename(f)[:-3]
        if name in ("lib", "main"):
            continue
        text = code(f)
        sub = os.path.join(src, name)
        if os.path.isdir(sub):
            for g in sorted(glob.glob(os.path.join(sub, "**", "*.rs"), recursive=True)):
                text += code(g)
        deps[name] = set(PATH.findall(text)) - {name}
    for name in deps:
        deps[name] &= set(deps)
    return deps


def circles(deps):
    found = set()

    def walk(start, node, path):
        for n in sorted(deps[node]):
            if n == start:
                found.add(tuple(path))
            elif n not in path and n > start:
                walk(start, n, path + [n])

    for m in sorted(deps):
        walk(m, m, [m])
    return sorted(found, key=lambda c: (len(c), c))


def main(dirs):
    bad = 0
    for src in dirs:
        found = circles(modules(src))
        for c in found:
            print(f"{src}: {' -> '.join(c + (c[0],))}")
        bad += len(found)
        if not found:
            print(f"{src}: no circle")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
