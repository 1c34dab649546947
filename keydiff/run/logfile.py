"""A run directory's run.log, opened only once the directory is settled (`HeldFileHandler`), so no line goes to
a moved-aside log. Standard library only. Design: docs/design/runs.md#run-directories-and-resume
"""

from __future__ import annotations

import logging
import os


class HeldFileHandler(logging.FileHandler):
    """logging.FileHandler that opens its file and writes its records only once settled (or at close)."""

    def __init__(self, filename: str, mode: str = "a", encoding: str | None = None, delay: bool = True,
                 errors: str | None = None) -> None:
        super().__init__(filename, mode, encoding, delay=True, errors=errors)
        self.held: list[logging.LogRecord] = []
        self.released = False

    def emit(self, record: logging.LogRecord) -> None:
        if not self.released:
            self.held.append(record)
        elif self.stream is not None or os.path.isdir(os.path.dirname(self.baseFilename)):
            super().emit(record)
        # else: the run directory was removed (the invocation wrote nothing): the console has the line

    def settle(self) -> None:
        """Open the file where it is now and write what was held. (Not `release`: that is Handler's lock.)"""
        self.released = True
        held, self.held = self.held, []
        for record in held:
            self.emit(record)

    def close(self) -> None:
        if not self.released and self.held and os.path.isdir(os.path.dirname(self.baseFilename)):
            self.settle()
        self.held = []
        super().close()


def release() -> None:
    """Release every HeldFileHandler of the root logger (none: another job_logging is configured)."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler, HeldFileHandler):
            handler.settle()
