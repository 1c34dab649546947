"""The one record of what produced a result: commit (and uncommitted changes), package versions, platform,
device, threads and OpenMP settings, command line and time (`provenance_record()`). Imports neither torch
nor hydra.

Design: docs/design/runs.md#provenance
"""

from __future__ import annotations

import os
import platform
import shlex
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any, Sequence

from keydiff import openmp

# Packages whose versions can change a result (the model stack, the metrics' dependencies, the data tools).
PACKAGES = ("torch", "transformers", "hydra-core", "accelerate", "gguf", "rouge", "jieba", "fuzzywuzzy",
            "python-Levenshtein", "rapidfuzz", "math-verify", "faker", "numpy", "wandb", "flash-attn")
TIME_FORMAT = "%Y-%m-%dT%H:%M:%S%z"  # local time with its UTC offset, e.g. 2026-11-24T10:45:48+0000
REPOSITORY = Path(__file__).resolve().parents[2]


def timestamp() -> str:
    """Now, as every result file writes it (TIME_FORMAT)."""
    return time.strftime(TIME_FORMAT)


def git_state(root: str | os.PathLike | None = None) -> dict[str, Any]:
    """{"commit": HEAD of the repository (None outside git), "dirty": uncommitted changes to tracked files}."""
    root = Path(root or REPOSITORY)

    def git(*args: str) -> str | None:
        try:
            return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10,
                                  check=True).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None

    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": commit, "dirty": bool(status) if status is not None else None}


def code_label(code: dict[str, Any]) -> str | None:
    """The commit as one string, "<sha>-dirty" when the tree had uncommitted changes (None outside git)."""
    return None if code.get("commit") is None else code["commit"] + ("-dirty" if code.get("dirty") else "")


def package_versions() -> dict[str, str | None]:
    """Python's version and each of PACKAGES' (None: not installed)."""
    versions: dict[str, str | None] = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def environment(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Platform, command line (argv, sys.argv's by default), torch's CPU threads and, with CUDA, the device."""
    env: dict[str, Any] = {"platform": platform.platform(), "argv": list(sys.argv if argv is None else argv)}
    try:
        import torch
    except ImportError:  # a torch-free caller (e.g. a report): no threads or device to record
        return env
    env["cpu_threads"] = torch.get_num_threads()
    env["openmp"] = openmp.settings()  # the runtime and the variables it started with (keydiff.openmp)
    if torch.cuda.is_available():
        env["cuda_device"] = torch.cuda.get_device_name()
        env["cuda"] = torch.version.cuda
    return env


def provenance_record(argv: Sequence[str] | None = None, root: str | os.PathLike | None = None) -> dict[str, Any]:
    """What produced a result, taken now: code (git_state), packages, environment (platform, argv, threads,
    device), the command line as one shell-quoted string, and the time (TIME_FORMAT)."""
    env = environment(argv)
    return {"code": git_state(root), "packages": package_versions(), "environment": env,
            "command": shlex.join([Path(env["argv"][0]).name, *env["argv"][1:]]) if env["argv"] else "",
            "time": timestamp()}
