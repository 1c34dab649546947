"""Stopping cleanly on SIGTERM / SIGUSR1 / SIGUSR2 (what SLURM sends before it kills or requeues a job) and on
SIGINT (Ctrl-C), all alike.

While a sample runs, the signal abandons it at once (`Preempted` is raised in the main thread, like
KeyboardInterrupt): nothing of that sample is written, and it runs again on the next start. While a row or
the summary is being written the signal only takes note; the write completes and the run stops right after.
So every row on disk is whole and no sample is lost or written twice.

After the runner has written its summary, `Preempted.deliver()` (called by run.py) hands the signal on to
whoever handled it before us: under submitit that is its handler, which requeues the job (SIGUSR2) or logs
(SIGTERM), then the process exits with status 128 + signal number (143 for SIGTERM); with the default
disposition the process re-raises the signal on itself and dies of it, as it would have without us. Ctrl-C
under Python's own SIGINT handler (which would raise KeyboardInterrupt and print a traceback) exits with
status 130, as a shell reports an interrupted command.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from typing import Any, Iterator

SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGINT") if hasattr(signal, name))


class Preempted(BaseException):
    """The run was stopped by a signal after writing what it had. BaseException: no `except Exception` eats it."""

    def __init__(self, signum: int, previous: Any):
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum
        self.previous = previous
        self.progress = ""  # set by the runner: "<done> of <total> samples done"

    def deliver(self) -> None:
        """Hand the signal to the handler that was installed before ours, then exit."""
        if self.signum == signal.SIGINT and self.previous in (signal.default_int_handler, None):
            sys.exit(128 + self.signum)  # Python's handler would raise KeyboardInterrupt: a traceback, no more
        if callable(self.previous):
            self.previous(self.signum, None)  # submitit: checkpoint + requeue, may exit itself
            sys.exit(128 + self.signum)
        if self.previous == signal.SIG_IGN:
            sys.exit(128 + self.signum)
        signal.signal(self.signum, signal.SIG_DFL)
        os.kill(os.getpid(), self.signum)
        sys.exit(128 + self.signum)  # not reached on POSIX


class StopSignals:
    """Installs the handlers for its lifetime; `interruptible()` marks where a signal may abandon work."""

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous: dict[int, Any] = {}
        self._interruptible = False

    def _handle(self, signum: int, frame) -> None:
        if self.received is None:
            self.received = signum
        if self._interruptible:
            self._interruptible = False
            raise Preempted(signum, self._previous.get(signum))

    def check(self) -> None:
        """Raise Preempted if a signal arrived while we were not interruptible."""
        if self.received is not None:
            raise Preempted(self.received, self._previous.get(self.received))

    @contextlib.contextmanager
    def interruptible(self) -> Iterator[None]:
        self.check()
        self._interruptible = True
        try:
            yield
        finally:
            self._interruptible = False

    def __enter__(self) -> "StopSignals":
        for signum in SIGNALS:
            previous = signal.getsignal(signum)
            if previous == signal.SIG_IGN:
                continue
            self._previous[signum] = previous
            signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
