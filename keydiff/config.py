"""OmegaConf resolvers the Hydra configs use (registered on `import keydiff`): they name a run's directory after
its budget, custom policy, task.limit, shard and protocol, so two settings never share a directory.

Design: docs/design/runs.md#run-directory-names
"""

from __future__ import annotations

import json
import re
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

# How attention-based policies get their statistic (keydiff.attention): the one list, torch-free so that the
# run configuration is checked before torch is imported.
STATISTICS_MODES = ("fast", "materialized")


def budget_label(tokens: int | None, ratio: float | None = None) -> str:
    if ratio is not None:
        return ratio_label(ratio)
    if tokens is None:
        return "none"
    tokens = int(tokens)
    return f"{tokens // 1024}k" if tokens > 0 and tokens % 1024 == 0 else str(tokens)


def ratio_label(ratio: Any) -> str:
    """"r0.25" for ratio 0.25 (shortest exact decimal); a non-number keeps its text, for checks to refuse."""
    if isinstance(ratio, (int, float)) and not isinstance(ratio, bool):
        return f"r{float(ratio)!r}".removesuffix(".0")
    return re.sub(r"[^A-Za-z0-9_.=+-]+", "_", f"r{ratio}")


def custom_policy_label(target: str | None, params: Any = None) -> str:
    """Directory label for a policy class given by dotted path: the class name, then key+value per parameter."""
    if not target:
        return "custom"
    if isinstance(params, (DictConfig, ListConfig)):
        params = OmegaConf.to_container(params, resolve=True)
    parts = [str(target).rpartition(".")[2]]
    for key in sorted(params or {}):
        value = params[key]
        if isinstance(value, (dict, list)):
            value = json.dumps(value, separators=(",", ":"), sort_keys=True)  # compact, deterministic
        parts.append(f"{key}{value}")
    return re.sub(r"[^A-Za-z0-9_.=+-]+", "_", "-".join(parts))


def limit_suffix(limit: int | None) -> str:
    """"" for a full run, "-limit<N>" for a subset run: a run directory's name says which it holds, so a
    `task.limit=2` run never writes into (or is mistaken for) the full run of the same grid point."""
    return "" if limit is None else f"-limit{limit}"


def shard_suffix(shard: Any) -> str:
    """"" for a whole grid point, "/shards/2of8" for `shard=2/8`: a shard is a run directory inside its grid
    point's (keydiff.run.shards.Shard.dirname names the same). Any other value is refused by the run's checks
    before a directory exists; it is only made safe as a path here."""
    if shard is None:
        return ""
    return "/shards/" + re.sub(r"[^A-Za-z0-9_.=+-]+", "_", str(shard).replace("/", "of", 1))


def protocol_suffix(query_aware: Any) -> str:
    """"" for the paper's protocol (query_aware=true: the directories of every earlier run), "-query-agnostic"
    for kvpress's (query_aware=false), so the two never share a run directory. A non-boolean is labelled by its
    text, for the checks to refuse."""
    if query_aware is True:
        return ""
    return "-query-agnostic" if query_aware is False else re.sub(r"[^A-Za-z0-9_.=+-]+", "_", f"-query_aware{query_aware}")


def register_resolvers() -> None:
    """Each resolver above under its own name (the configs' `${name:...}`), once per process."""
    for resolver in (budget_label, custom_policy_label, limit_suffix, shard_suffix, protocol_suffix):
        if not OmegaConf.has_resolver(resolver.__name__):
            OmegaConf.register_new_resolver(resolver.__name__, resolver)
