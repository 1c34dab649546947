"""How this project's processes use the CPU: the OpenMP settings torch's CPU ops run under, chosen per kind of
process (runs, benchmarks, tests), and the record of them that results carry.

    openmp.prepare("run")    # first thing in an entry point, before anything imports torch
    openmp.settings()        # what was in effect: {"library", "variables", "set_by_keydiff"}

libgomp reads its environment once, when torch loads it; a variable the user set is never changed. Imports
nothing that imports torch. Design: docs/performance.md#cpu-threads
"""

from __future__ import annotations

import os
import sys
from typing import Any, MutableMapping

# The environment each kind of process starts torch with (only where the user set nothing).
DEFAULTS: dict[str, dict[str, str]] = {
    "run": {"OMP_WAIT_POLICY": "PASSIVE"},
    "bench": {"OMP_WAIT_POLICY": "PASSIVE"},
    "test": {"OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": "1"},  # tiny models: a second thread buys nothing
}
# A default is not applied where the user set another name for the same setting.
SAME_SETTING = {"OMP_WAIT_POLICY": ("GOMP_SPINCOUNT",)}
# The variables results record when set: OpenMP's, libgomp's, MKL's and Intel OpenMP's (recorded, not used).
VARIABLES = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_PROC_BIND", "OMP_PLACES", "OMP_DYNAMIC",
             "GOMP_CPU_AFFINITY", "MKL_NUM_THREADS", "KMP_BLOCKTIME", "KMP_AFFINITY")

_set_by_keydiff: dict[str, str] = {}  # what prepare() put into this process's environment


def prepare(kind: str, environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Put DEFAULTS[kind] into the environment where the user set nothing; returns what it set. Sets nothing once
    torch is imported (OpenMP has read its settings by then): an entry point calls it first."""
    if kind not in DEFAULTS:
        raise ValueError(f"unknown kind of process {kind!r}; valid: {', '.join(DEFAULTS)}")
    environ = os.environ if environ is None else environ
    if "torch" in sys.modules and environ is os.environ:
        return {}
    chosen = {name: value for name, value in DEFAULTS[kind].items()
              if name not in environ and not any(other in environ for other in SAME_SETTING.get(name, ()))}
    environ.update(chosen)
    if environ is os.environ:
        _set_by_keydiff.update(chosen)
    return chosen


def library() -> str | None:
    """The OpenMP runtime this process has loaded (e.g. "libgomp.so.1"), from /proc/self/maps; None where
    none is loaded or the platform has no /proc."""
    try:
        with open("/proc/self/maps", encoding="utf-8") as maps:
            names = {line.rsplit("/", 1)[-1].strip() for line in maps if "/" in line}
    except OSError:
        return None
    found = sorted(name for name in names if name.startswith(("libgomp", "libiomp", "libomp")))
    return ", ".join(found) or None


def settings() -> dict[str, Any]:
    """The threading in effect, for a result's provenance: the OpenMP runtime loaded, every variable of VARIABLES
    that is set (os.environ's now), and which of them prepare() set."""
    return {"library": library(),
            "variables": {name: os.environ[name] for name in VARIABLES if name in os.environ},
            "set_by_keydiff": sorted(_set_by_keydiff)}


def describe() -> str:
    """The variables in effect as one `NAME=value ...` string ("" when none is set), for a benchmark's setting line."""
    return " ".join(f"{name}={value}" for name, value in settings()["variables"].items())
