"""Checks of a run's configuration that need neither torch nor the model.

run.py and the sweeper call `check_run_config` before torch or transformers are imported and before any
directory is created, so a typo fails in about a second with one line that names the key, the value and
what is valid. The runner repeats the checks that need the policy classes (policy parameters, budget
against the policy's own constraints) after importing torch, still before loading the model.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

STATISTICS_MODES = ("fast", "materialized")  # keydiff.cache.STATISTICS_MODES, repeated to stay torch-free


class ConfigError(ValueError):
    """A configuration value is not valid. The message names the key and the valid values."""


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _check_positive_int(key: str, value: Any, *, optional: bool, hint: str = "") -> None:
    if value is None and optional:
        return
    if not _positive_int(value):
        valid = "a positive integer" + (" or null" if optional else "") + hint
        raise ConfigError(f"{key}={value!r} is not valid; valid: {valid}")


def _check_bool(key: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"{key} must be true or false, got {value!r}")


def check_block_size(value: Any) -> None:
    if isinstance(value, str) and value.lower() in ("inf", "infinity", "none"):
        return
    if value is None or (isinstance(value, float) and value == float("inf")):
        return
    if not _positive_int(value):
        raise ConfigError(
            f"block_size={value!r} is not valid; block_size must be a positive integer (paper: 64, 128, 256) "
            "or inf (the whole prompt as one block)"
        )


def check_results_root(root: str | os.PathLike) -> None:
    """The nearest existing ancestor of the results root must be a writable directory."""
    path = Path(root).expanduser().absolute()
    probe = path
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir() or not os.access(probe, os.W_OK | os.X_OK):
        raise ConfigError(
            f"results_root={str(root)!r} is not writable ({probe} is not a writable directory); "
            "valid: a directory you can write to (results_root=/scratch/$USER/keydiff)"
        )


def check_run_config(cfg: DictConfig) -> None:
    """Every check that needs no torch: top-level values, the model entry, the task (built, not loaded)."""
    from hydra.utils import instantiate

    from keydiff.models import ModelConfig

    check_block_size(cfg.block_size)
    if cfg.attention_statistics not in STATISTICS_MODES:
        raise ConfigError(
            f"attention_statistics={cfg.attention_statistics!r} is not valid; valid: {', '.join(STATISTICS_MODES)}"
        )
    if cfg.policy.name != "full":
        _check_positive_int("budget.tokens", cfg.budget.tokens, optional=False,
                            hint=" (budget must be a positive integer number of tokens)")
    if isinstance(cfg.seed, bool) or not isinstance(cfg.seed, int):
        raise ConfigError(f"seed={cfg.seed!r} is not valid; valid: an integer")
    for key in ("decode_eviction", "overwrite", "retry_failed", "dry_run"):
        _check_bool(key, cfg.get(key, False))
    _check_positive_int("threads", cfg.get("threads"), optional=True, hint=" (null: SLURM_CPUS_PER_TASK or torch's default)")
    _check_positive_int("max_prompt_tokens", cfg.get("max_prompt_tokens"), optional=True)
    lock_wait = cfg.get("lock_wait", 0)
    if isinstance(lock_wait, bool) or not isinstance(lock_wait, (int, float)) or lock_wait < 0:
        raise ConfigError(f"lock_wait={lock_wait!r} is not valid; valid: seconds >= 0 (0: refuse at once)")
    _check_positive_int("task.limit", cfg.task.get("limit"), optional=True, hint=" (null: every sample)")
    check_results_root(cfg.results_root)

    model_cfg = ModelConfig.from_dict(OmegaConf.to_container(cfg.model, resolve=True))
    model_cfg.validate()
    task = instantiate(cfg.task, _convert_="all")
    task.validate()
    task.check_model(model_cfg.max_length)


def describe_error(error: BaseException) -> str:
    """One line for a user error: an unknown config choice lists the valid ones, anything else its message."""
    from hydra.errors import MissingConfigException

    if isinstance(error, MissingConfigException) and error.options and error.missing_cfg_file:
        group, _, name = str(error.missing_cfg_file).rpartition("/")
        return f"{group}={name} is not valid; valid: {', '.join(sorted(error.options))}"
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    return " | ".join(lines[:6]) if lines else type(error).__name__


def exit_with_error(message: str, code: int = 2) -> None:
    """Print `error: <message>` on stderr and exit: user errors get one line, not a traceback."""
    import sys

    print(f"error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(code)


def _check_single_run(config: DictConfig) -> None:
    """Hydra callback body for a single run: the checks (and dry_run) before Hydra creates the run directory."""
    from keydiff.sweep import run_dir_of

    try:
        check_run_config(config)
    except ValueError as error:
        exit_with_error(describe_error(error))
    if config.get("dry_run", False):
        print(f"dry run: would write {run_dir_of(config)}; nothing is run")
        raise SystemExit(0)


try:
    from hydra.experimental.callback import Callback
except ImportError:  # pragma: no cover - hydra < 1.1
    Callback = object


class CheckBeforeStart(Callback):
    """`hydra.callbacks.check`: runs the torch-free checks of a single run before its directory exists
    (sweeps are checked point by point by the keydiff sweeper before any job starts)."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        _check_single_run(config)
