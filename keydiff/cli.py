"""What every command-line entry point shares: a user's mistake is one line, `error: <message>`, and exit status 2.

A leaf module (standard library only), so that run.py, the report, the benchmarks and the paper tools import it
without importing one another."""

from __future__ import annotations

import argparse
import sys
from typing import Any, NoReturn


class ArgumentParser(argparse.ArgumentParser):
    """argparse for the project's command-line tools (the make targets): a user's mistake is run.py's one line,
    `error: <message>`, and exit status 2, not a usage block followed by the message."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        main = getattr(sys.modules.get("__main__"), "__spec__", None)  # `python -m keydiff.x`: name the module
        if "prog" not in kwargs and main is not None and main.name.startswith("keydiff"):
            kwargs["prog"] = f"python -m {main.name}"
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        exit_with_error(f"{message} (usage: {self.prog} --help)")


def exit_with_error(message: str, code: int = 2) -> NoReturn:
    """Print `error: <message>` on stderr and exit: user errors get one line, not a traceback."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(code)
