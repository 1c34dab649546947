#!/usr/bin/env python3
"""Which lines of keydiff/ each test runs, over the whole suite: the check that a cut of the tests loses no line.

  per_test.py unique BASE FILE...     per test function of these test files: the keydiff lines no other test runs
  per_test.py lost BASE AFTER FILE... lines only these files' tests ran at BASE and their new version (AFTER) does not
  per_test.py union BASE AFTER        lines the whole suite ran at BASE and does not run at AFTER (AFTER: a whole run)
BASE: coverage data of a whole-suite run with per-test contexts (README.md); AFTER: coverage data of the new tests,
contexts not needed. FILE: test file names (test_cache.py). Lines run only in subprocesses are measured by neither.
"""
import os
import re
import sys
from collections import defaultdict

from coverage import CoverageData


def rel(path):
    return path[path.rfind("/keydiff/") + 1:]


def module_of(context):
    """`tests.test_cache.test_name` -> `test_cache`; the empty context (imports, fixtures) -> None."""
    match = re.match(r"(?:tests\.)?(test_\w+)\.", context)
    return match.group(1) if match else None


def read(path):
    data = CoverageData(basename=path)
    data.read()
    return data


def contexts_per_line(path):
    data = read(path)
    return {(rel(f), ln): set(c for c in ctxs if c) for f in data.measured_files()
            for ln, ctxs in data.contexts_by_lineno(f).items()}


def lines(path):
    data = read(path)
    return {(rel(f), ln) for f in data.measured_files() for ln in (data.lines(f) or ())}


def modules(files):
    return {os.path.basename(f).removesuffix(".py") for f in files}


def ranges(numbers):
    out = []
    for n in sorted(numbers):
        if out and n == out[-1][1] + 1:
            out[-1][1] = n
        else:
            out.append([n, n])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in out)


def show(keys):
    by_file = defaultdict(list)
    for f, ln in keys:
        by_file[f].append(ln)
    return "; ".join(f"{f}:{ranges(ls)}" for f, ls in sorted(by_file.items()))


def unique(base, files):
    mods, only, seen = modules(files), defaultdict(list), set()
    for key, ctxs in contexts_per_line(base).items():
        seen.update(c for c in ctxs if module_of(c) in mods)
        if len(ctxs) == 1 and module_of(next(iter(ctxs))) in mods:
            only[next(iter(ctxs))].append(key)
    for c in sorted(seen):
        print(f"{len(only[c]):5d}  {c}  {show(only[c])}")


def lost(base, after, files):
    mods, mine = modules(files), set()
    for key, ctxs in contexts_per_line(base).items():
        if ctxs and all(module_of(c) in mods for c in ctxs):
            mine.add(key)
    gone = mine - lines(after)
    print(f"{len(gone)} lines only these files' tests ran at base and do not run now")
    if gone:
        print("  " + show(gone).replace("; ", "\n  "))


def union(base, after):
    before, now = lines(base), lines(after)
    gone = before - now
    print(f"base {len(before)} lines, now {len(now)}, lost {len(gone)}, newly run {len(now - before)}")
    if gone:
        print("  " + show(gone).replace("; ", "\n  "))


if __name__ == "__main__":
    command, args = (sys.argv[1], sys.argv[2:]) if len(sys.argv) > 1 else ("", [])
    if command == "unique" and len(args) >= 2:
        unique(args[0], args[1:])
    elif command == "lost" and len(args) >= 3:
        lost(args[0], args[1], args[2:])
    elif command == "union" and len(args) == 2:
        union(*args)
    else:
        sys.exit(__doc__)
