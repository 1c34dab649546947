"""A run directory's run.log, opened only once the directory is settled.

Hydra opens its job log file (`<run dir>/run.log`) before run.py runs. With `overwrite=true` the old run's files,
its run.log included, are then moved aside (keydiff.run.results.move_aside), and a file handler opened before
the move would go on writing this invocation's lines into the moved-aside log. So the job's file handler is
`HeldFileHandler` (conf/hydra/job_logging/keydiff.yaml): it keeps the records it gets until run.py calls
`release()`, under the run's lock and after any move, and then writes them, and every later one, to run.log.
A process that ends before releasing (a refused configuration) writes them at exit, unless its run directory
is gone (removed because the invocation wrote nothing into it); records after such a removal are dropped
(the console has them). Standard library only.
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
