"""One writer per run directory: a lock file (`<run_dir>/.lock`, created atomically) naming its host, pid and
start time; a stale one is taken over. Design: docs/design/runs.md#the-lock
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any

from keydiff.run.provenance import timestamp

LOCK_NAME = ".lock"
_HELD: set[Path] = set()  # the lock files this process holds now


class RunLockedError(RuntimeError):
    """Another live process holds the run directory."""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


class RunLock:
    """Context manager: `with RunLock(run_dir, wait_s=0): ...` holds `<run_dir>/.lock` for its duration."""

    def __init__(self, run_dir: str | os.PathLike, wait_s: float = 0.0, poll_s: float = 0.5):
        self.path = Path(run_dir) / LOCK_NAME
        self.wait_s = float(wait_s)
        self.poll_s = poll_s
        self.record = {"host": socket.gethostname(), "pid": os.getpid(), "started": timestamp()}
        self.held = False

    def holder(self) -> dict[str, Any] | None:
        return self._read(self.path)

    @staticmethod
    def _read(path: Path) -> dict[str, Any] | None:
        try:
            return json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return None
        except (json.JSONDecodeError, OSError):
            return {}  # being written right now, or garbage: treated as held

    def _try_create(self) -> bool:
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            json.dump(self.record, handle)
        return True

    def _is_stale(self, holder: dict[str, Any]) -> bool:
        """Written on this host by a process that is gone: its pid is dead, or it is ours and we do not hold it."""
        if holder.get("host") != self.record["host"] or not isinstance(holder.get("pid"), int):
            return False
        if holder["pid"] == self.record["pid"]:
            return self.path.absolute() not in _HELD
        return not _pid_alive(holder["pid"])

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        deadline = time.monotonic() + self.wait_s
        while not self._try_create():
            holder = self.holder()
            if holder is None:
                continue  # released between our attempt and the read
            if holder.get("host") == self.record["host"] and holder.get("pid") == self.record["pid"] \
                    and self.path.absolute() in _HELD:
                raise RunLockedError(f"{self.path.parent} is locked by this process already (a run inside a run); "
                                     "a run directory has one writer")
            if self._is_stale(holder):
                stale = self.path.with_name(f"{LOCK_NAME}.stale-{os.getpid()}")
                try:
                    os.replace(self.path, stale)
                except FileNotFoundError:
                    continue
                if self._read(stale) != holder:  # another process took over first: give its lock back
                    try:
                        os.link(stale, self.path)
                    except FileExistsError:
                        pass
                stale.unlink(missing_ok=True)
                continue
            if time.monotonic() >= deadline:
                raise RunLockedError(
                    f"{self.path.parent} is being written by another process (host {holder.get('host')}, "
                    f"pid {holder.get('pid')}, since {holder.get('started')}); not starting a second writer. "
                    f"Wait for it, pass lock_wait=<seconds>, or delete {self.path} if that process is gone."
                )
            time.sleep(self.poll_s)
        _HELD.add(self.path.absolute())
        self.held = True

    def release(self) -> None:
        if not self.held:
            return
        self.held = False
        _HELD.discard(self.path.absolute())
        if self.holder() == self.record:  # never remove a lock another process has taken over meanwhile
            self.path.unlink(missing_ok=True)

    def __enter__(self) -> "RunLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()
