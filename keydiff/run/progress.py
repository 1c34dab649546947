"""Progress of a run's sample loop: a tqdm bar only when stderr is a terminal (in a log file it would be one
long line), and one INFO log line per finished sample everywhere.

Design: docs/design/runs.md#run-directories-and-resume
"""

from __future__ import annotations

import contextlib
import logging
import sys
from typing import Any

log = logging.getLogger(__name__)


def on_terminal(stream: Any = None) -> bool:
    """Whether `stream` (default: sys.stderr, where tqdm draws) is a terminal."""
    stream = sys.stderr if stream is None else stream
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # replaced or closed stream
        return False


def short(value: Any) -> str:
    """A number with 4 significant digits (whole numbers from 1,000 up with thousands separators)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, int) or (abs(value) >= 1000 and value == value):
        return f"{value:,.0f}"
    return f"{value:.4g}"


def sample_line(row: dict[str, Any], index: int, total: int, score_name: str) -> str:
    """'sample 3/6 L800/d50: needle_recall 1, 812 prompt tokens, kept 0.25, TTFT 0.05612 s, 50 new tokens' (a
    failed sample: its reason)."""
    head = f"sample {index}/{total} {row.get('sample_id')}"
    if row.get("status", "ok") != "ok":
        return f"{head}: failed ({row.get('failure_reason', 'unknown')}, {row.get('prompt_tokens')} prompt tokens)"
    scores = row.get("scores") or {}
    parts = [f"{score_name} {short(scores[score_name])}"] if score_name in scores else []
    kept = row.get("kept_ratio", row.get("compression_ratio"))
    parts += [f"{short(row.get('prompt_tokens'))} prompt tokens"] + ([f"kept {short(kept)}"] if kept is not None else [])
    parts += [f"TTFT {short(row.get('ttft_s'))} s", f"{short(row.get('new_tokens'))} new tokens"]
    return f"{head}: " + ", ".join(parts)


class Progress:
    """The loop's progress: `with Progress(total, "niah_small/keydiff", "needle_recall") as progress:`, then
    `progress.done(row)` after each row is written."""

    def __init__(self, total: int, description: str, score_name: str, terminal: bool | None = None):
        self.total, self.description, self.score_name = total, description, score_name
        self.terminal = on_terminal() if terminal is None else terminal
        self.count = 0
        self.bar = None
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> "Progress":
        if self.terminal:
            from tqdm.auto import tqdm  # here: run.py imports this module before it checks anything
            from tqdm.contrib.logging import logging_redirect_tqdm

            self._stack.enter_context(logging_redirect_tqdm())
            self.bar = self._stack.enter_context(tqdm(total=self.total, desc=self.description, unit="sample"))
        return self

    def done(self, row: dict[str, Any]) -> None:
        self.count += 1
        log.info("%s", sample_line(row, self.count, self.total, self.score_name))
        if self.bar is not None:
            self.bar.update(1)

    def __exit__(self, *exc) -> None:
        self._stack.close()
