"""The optional extras of pyproject.toml, and the one-line error for a feature whose extra is not installed
(`require(extra, module, feature)` raises `MissingExtra` naming the pip command). `MissingExtra` is both an
ImportError and a ValueError, so the configuration checks refuse `logger=wandb` or `task=math500` without
their package like any other bad setting, before any run directory exists.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

# The extras of pyproject.toml (their packages are listed there only), what asks for each, and what `pip install`
# needs beyond `-e '.[extra]'`.
EXTRAS: dict[str, str] = {
    "report": "",  # python -m keydiff.report.wandb (make report): W&B report specifications
    "wandb": "",  # logger=wandb, make wandb-sync
    "slurm": "",  # hydra/launcher=slurm (submitit), the joblib launcher; make sweep-slurm
    "datasets": "",  # task=math500 without task.data_dir: MATH-500 from the Hub
    "levenshtein": "",  # only the tests' comparison with python-Levenshtein (task.fuzzy_backend=levenshtein: rapidfuzz)
    "flash": " --no-build-isolation",  # attn_implementation=flash_attention_2 (CUDA)
    "triton": "",  # batch_invariant=true's kernels (in torch's CUDA build already); tests/test_batch_invariant.py
}


class MissingExtra(ImportError, ValueError):
    """A feature was asked for whose optional extra is not installed; the message is the one line to show."""


def install_command(extra: str) -> str:
    """`pip install -e '.[report]'`: what installs `extra` into this checkout's environment."""
    if extra not in EXTRAS:
        raise ValueError(f"unknown extra {extra!r}; valid: {', '.join(EXTRAS)}")
    return f"pip install -e '.[{extra}]'{EXTRAS[extra]}"


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
    """Import `module` (part of `extra`) for `what`, or raise MissingExtra naming the extra to install. Only a missing
    module or package counts: an installed package failing otherwise raises its own error."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as error:
        raise missing(extra, what, error.name or module, otherwise) from error  # the module that is not there
