"""Every experiment's grid of jobs, read from conf/experiment through Hydra's compose API.

The one place a grid is computed (sweeper, `make status`, W&B reports, GPU hours, the paper registry's checks), in
the order Hydra's BasicSweeper launches the jobs, with its own parser and product. Imports only Hydra and
OmegaConf (no torch), so every layer may use it.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Iterable

from hydra import compose, initialize_config_dir
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from omegaconf import OmegaConf

CONF = Path(__file__).resolve().parents[1] / "conf"  # the repository's Hydra configs, as run.py reads them


def sweep_points(overrides: Iterable[str], config_loader=None) -> list[list[str]]:
    """The jobs of a sweep over `overrides` (an experiment's `hydra.sweeper.params` as `key=values`, then the
    command line): BasicSweeper's grid, in its order. A key given twice keeps its first place and its last values."""
    parsed = OverridesParser.create(config_loader=config_loader).parse_overrides(list(overrides))
    for override in parsed:
        if override.is_sweep_override() and not override.is_discrete_sweep():
            raise HydraException(f"the keydiff sweeper does not support the sweep {override.input_line!r} "
                                 f"({override.value_type.name}); list the values: key=a,b,c or key=range(...)")
    return BasicSweeper.split_arguments(parsed, None)[0]


def sweep_params(cfg) -> list[str]:
    """A composed config's sweep axes (`hydra.sweeper.params`) as `key=values` overrides."""
    params = OmegaConf.to_container(cfg.hydra.sweeper.params or {}, resolve=False)
    return [f"{key}={value}" for key, value in params.items()]


def experiment_grid(name: str, overrides: Iterable[str] = ()) -> list[list[str]]:
    """Every job of conf/experiment/<name>.yaml (plus `overrides`, as given to `run.py -m`): each the list of
    overrides that composes it (`compose("config", overrides=point)`)."""
    return [list(point) for point in _composed_grid(name, tuple(overrides))]


@lru_cache(maxsize=None)
def _composed_grid(name: str, overrides: tuple[str, ...]) -> tuple[tuple[str, ...], ...]:
    """experiment_grid's jobs, composed once per process and arguments (about 0.1 s of Hydra each; the GPU-hours
    estimate, W&B's reports and the tests ask for the same grids). A process does not see conf/ change under it."""
    arguments = [f"experiment={name}", *overrides]
    with initialize_config_dir(str(CONF), version_base="1.3"):
        loader = GlobalHydra.instance().config_loader()
        parsed = OverridesParser.create(config_loader=loader).parse_overrides(arguments)
        fixed = [override.input_line for override in parsed if not override.is_sweep_override()]
        master = compose("config", overrides=fixed, return_hydra_config=True)
        return tuple(map(tuple, sweep_points([*sweep_params(master), *arguments], loader)))


def grid_axes(points: list[list[str]]) -> dict[str, list[str]]:
    """key -> its values in the grid's order (the point's keys in theirs): an experiment's axes, read back."""
    axes: dict[str, list[str]] = {}
    for point in points:
        for override in point:
            key, value = override.split("=", 1)
            values = axes.setdefault(key, [])
            if value not in values:
                values.append(value)
    return axes


def experiments() -> list[str]:
    """The names of conf/experiment's files."""
    return sorted(path.stem for path in (CONF / "experiment").glob("*.yaml"))
