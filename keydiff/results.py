"""Result files of one run, written so that nothing is ever lost or silently overwritten.

A run directory holds:
  run_config.json    the resolved configuration that produced it (checked on every resume)
  predictions.jsonl  one JSON object per finished sample, appended and fsynced one at a time
  summary.json       metrics + provenance (config, git commit, package versions, data hashes),
                     rewritten atomically (temp file + rename) at the end of every invocation
A crash can at worst leave a partial last line in predictions.jsonl; `ResultStore` drops exactly that
line on the next start and keeps every complete one.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

PACKAGES = ("torch", "transformers", "hydra-core", "accelerate", "gguf", "rouge", "jieba", "fuzzywuzzy",
            "python-Levenshtein", "rapidfuzz", "math-verify", "faker", "numpy", "wandb", "flash-attn")


class ConfigMismatchError(RuntimeError):
    """The run directory holds results produced by a different configuration."""


def atomic_write_json(path: Path, data: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as handle:
        json.dump(data, handle, indent=2, ensure_ascii=False, default=str)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def _diff(old: Any, new: Any, prefix: str = "") -> list[str]:
    if isinstance(old, dict) and isinstance(new, dict):
        lines = []
        for key in sorted(set(old) | set(new)):
            lines += _diff(old.get(key, "<missing>"), new.get(key, "<missing>"), f"{prefix}{key}.")
        return lines
    return [] if old == new else [f"{prefix.rstrip('.')}: {old!r} -> {new!r}"]


class ResultStore:
    """Append-only per-sample rows plus an atomic summary, in one run directory."""

    def __init__(self, run_dir: str | os.PathLike, run_config: dict[str, Any], overwrite: bool = False):
        self.dir = Path(run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.predictions = self.dir / "predictions.jsonl"
        self.config_path = self.dir / "run_config.json"
        if overwrite and (self.predictions.exists() or self.config_path.exists()):
            self._move_aside()
        if self.config_path.exists():
            previous = json.loads(self.config_path.read_text(encoding="utf-8"))
            differences = _diff(previous, run_config)
            if differences:
                raise ConfigMismatchError(
                    f"{self.dir} holds results of a different configuration:\n  " + "\n  ".join(differences)
                    + "\nUse another experiment_name / policy.label, or overwrite=true to move the old run aside."
                )
        else:
            atomic_write_json(self.config_path, run_config)
        self.rows = self._load_rows()

    def _move_aside(self) -> None:
        """overwrite=true never deletes: the old files move into a timestamped sibling folder."""
        stamp = time.strftime("%Y%m%d-%H%M%S")
        backup = self.dir.with_name(f"{self.dir.name}.old-{stamp}")
        backup.mkdir(parents=True)
        for path in list(self.dir.iterdir()):
            if path.name != ".hydra":
                path.rename(backup / path.name)

    def _load_rows(self) -> list[dict[str, Any]]:
        if not self.predictions.exists():
            return []
        rows, good_bytes = [], 0
        with open(self.predictions, "rb") as handle:
            for raw in handle:
                if not raw.endswith(b"\n"):
                    break  # a partial line from a crash mid-write
                try:
                    rows.append(json.loads(raw))
                except json.JSONDecodeError:
                    break
                good_bytes += len(raw)
        if good_bytes != self.predictions.stat().st_size:
            with open(self.predictions, "rb+") as handle:
                handle.truncate(good_bytes)
        return rows

    @property
    def done_ids(self) -> set[str]:
        return {row["sample_id"] for row in self.rows}

    def append(self, row: dict[str, Any]) -> None:
        line = json.dumps(row, ensure_ascii=False, default=str) + "\n"
        with open(self.predictions, "a", encoding="utf-8") as handle:
            handle.write(line)
            handle.flush()
            os.fsync(handle.fileno())
        self.rows.append(row)

    def write_summary(self, summary: dict[str, Any]) -> Path:
        path = self.dir / "summary.json"
        atomic_write_json(path, summary)
        return path


def git_state(root: str | os.PathLike | None = None) -> dict[str, Any]:
    """Commit of the code that ran and whether the working tree had uncommitted changes."""
    root = Path(root or Path(__file__).resolve().parent.parent)

    def git(*args: str) -> str | None:
        try:
            return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10, check=True).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None

    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": commit, "dirty": bool(status) if status is not None else None}


def package_versions() -> dict[str, str | None]:
    versions: dict[str, str | None] = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def environment() -> dict[str, Any]:
    import torch

    env: dict[str, Any] = {"platform": platform.platform(), "argv": sys.argv, "cpu_threads": torch.get_num_threads()}
    if torch.cuda.is_available():
        env["cuda_device"] = torch.cuda.get_device_name()
        env["cuda"] = torch.version.cuda
    return env
