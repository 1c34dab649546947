"""The optional extras of pyproject.toml, and the one-line error for a feature whose extra is not installed.

A core install (`pip install -e .`) lacks what only some features need. Asking for such a feature must say which
extra to install, in one line, not end in a ModuleNotFoundError traceback from deep inside the feature:

    wr = require("report", "wandb_workspaces.reports.v2", "python -m keydiff.report.wandb")
    # MissingExtra: python -m keydiff.report.wandb needs the 'report' extra: pip install -e '.[report]' ...

`MissingExtra` is both an ImportError (what happened) and a ValueError (what the project's configuration checks
catch: run.py, the sweeper and the Hydra callback print a ValueError as `error: ...` before any run directory
exists), so `logger=wandb` or `task=math500` without their package is refused like any other bad setting.
Command-line tools catch it in their `main` and exit with its line (keydiff.run.checks.exit_with_error).
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

# extra -> (what needs it, how to install it beyond `pip install -e '.[extra]'`). The extras themselves (their
# packages and versions) are listed once, in pyproject.toml.
EXTRAS: dict[str, tuple[str, str]] = {
    "report": ("W&B report specifications (python -m keydiff.report.wandb, make report)", ""),
    "wandb": ("W&B logging (logger=wandb, make wandb-sync)", ""),
    "slurm": ("the SLURM and joblib Hydra launchers (hydra/launcher=slurm, make sweep-slurm)", ""),
    "datasets": ("Math-500 from the Hugging Face Hub (task=math500 without task.data_dir)", ""),
    "levenshtein": ("fuzzywuzzy's python-Levenshtein backend (only to compare code_sim with it; "
                    "task.fuzzy_backend=levenshtein needs no extra)", ""),
    "flash": ("attn_implementation=flash_attention_2 (CUDA)", " --no-build-isolation"),
}


class MissingExtra(ImportError, ValueError):
    """A feature was asked for whose optional extra is not installed; the message is the one line to show."""


def install_command(extra: str) -> str:
    """`pip install -e '.[report]'`: what installs `extra` into this checkout's environment."""
    if extra not in EXTRAS:
        raise ValueError(f"unknown extra {extra!r}; valid: {', '.join(EXTRAS)}")
    return f"pip install -e '.[{extra}]'{EXTRAS[extra][1]}"


def missing(extra: str, what: str, module: str | None = None, otherwise: str = "") -> MissingExtra:
    """The error for `what` (the feature or command asked for) when `extra` is not installed; `otherwise`: a way
    that needs no extra ("task.data_dir=<folder with test.jsonl>")."""
    lacking = f" (no module {module})" if module else ""
    alternative = f"; or {otherwise}" if otherwise else ""
    return MissingExtra(f"{what} needs the {extra!r} extra{lacking}: {install_command(extra)}{alternative}")


def installed(module: str) -> bool:
    """Whether `module` can be imported here, without importing it."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package is missing, or hidden (sys.modules[name] = None)
        return False


def require(extra: str, module: str, what: str, otherwise: str = "") -> ModuleType:
    """Import `module` (part of `extra`) for `what`, or raise MissingExtra naming the extra to install.

    Only the absence of the module or of a package it needs counts as a missing extra: an installed package that
    fails in another way raises its own error, which installing the extra again would not fix."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as error:
        raise missing(extra, what, error.name or module, otherwise) from error  # the module that is not there
