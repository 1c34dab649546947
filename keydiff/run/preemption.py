"""Stopping cleanly on SIGTERM / SIGUSR1 / SIGUSR2 (SLURM's warnings) and SIGINT (Ctrl-C), all alike.

A signal abandons the running sample (`Preempted`) but lets a write complete; `Preempted.deliver()` then hands
it to the previous handler. Design: docs/design/runs.md#preemption
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
