"""Checks of a run's configuration that need neither the model nor a run directory.

`check_command_line` (run.py's command line, composed as Hydra will) and `check_run_config` (once per run, before
any directory is created); also the Hub probe, the device check and `drop_whole_task_limit`.
Design: docs/design/runs.md#one-run
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import re
import ssl
import threading
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Callable, Sequence

from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from keydiff import extras
from keydiff.cli import exit_with_error
from keydiff.config import STATISTICS_MODES, ratio_label
from keydiff.run.results import run_dir_of
from keydiff.run.shards import parse_shard


log = logging.getLogger(__name__)


class ConfigError(ValueError):
    """A configuration value is not valid. The message names the key and the valid values."""


def _positive(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


_ABSENT = object()
NOT_VALID = "{key}={value!r} is not valid; valid: "
POSITIVE = NOT_VALID + "a positive integer"
# key -> (whether a value is valid, the one line refusing it): the values one test of type and range settles, in
# the order they are checked. A table, not a Hydra structured config: a schema would add or reorder keys in the
# recorded config (budget.ratio, model.device_map), refuse conf/local's own keys and coerce 1 or "yes" to true.
VALUES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "block_size": (lambda v: _positive(v) or str(v).lower() in ("inf", "infinity", "none"),
                   "{key}={value!r} is not valid; block_size must be a positive integer (paper: 64, 128, 256) or inf "
                   "(the whole prompt as one block)"),
    "attention_statistics": (lambda v: v in STATISTICS_MODES, NOT_VALID + ", ".join(STATISTICS_MODES)),
    "seed": (lambda v: isinstance(v, int) and not isinstance(v, bool), NOT_VALID + "an integer"),
    **dict.fromkeys(("decode_eviction", "query_aware", "batch_invariant", "overwrite", "retry_failed", "dry_run"),
                    (lambda v: isinstance(v, bool), "{key} must be true or false, got {value!r}")),
    "threads": (lambda v: v is None or _positive(v),
                POSITIVE + " or null (null: SLURM_CPUS_PER_TASK or torch's default)"),
    "max_prompt_tokens": (lambda v: v is None or _positive(v), POSITIVE + " or null"),
    "batch_size": (_positive, POSITIVE + " (1: one sample at a time)"),
    "lock_wait": (lambda v: _number(v) and v >= 0, NOT_VALID + "seconds >= 0 (0: refuse at once)"),
    "task.limit": (lambda v: v is None or _positive(v), POSITIVE + " or null (null: every sample)"),
    "budget.tokens": (_positive, POSITIVE + " (budget must be a positive integer number of tokens, or budget=r0.25 "
                                            "for a ratio)"),
    "budget.ratio": (lambda v: _number(v) and 0 < v <= 1, NOT_VALID + "a number with 0 < ratio <= 1 (the fraction of "
                                                                      "the prompt kept, e.g. budget=r0.25)"),
}
# Experiments that time a sample's latency alone (TTFT): decoding neighbours would share the machine with it.
LATENCY_EXPERIMENTS = ("fig7_ttft", "fig17_ttft_eager")


def check_value(key: str, value: Any) -> None:
    """Refuse a value its rule in VALUES does not accept, with that rule's one line."""
    accepts, message = VALUES[key]
    if not accepts(value):
        raise ConfigError(message.format(key=key, value=value))


def check_budget_config(budget: DictConfig) -> None:
    """A budget is either `tokens` (N, the same for every sample) or `ratio` (N = ceil(ratio x prompt tokens)
    per sample, 0 < ratio <= 1), never both."""
    ratio = budget.get("ratio")
    if ratio is None:
        return check_value("budget.tokens", budget.tokens)
    if budget.get("tokens") is not None:
        raise ConfigError(f"budget.tokens={budget.tokens!r} and budget.ratio={ratio!r} are both set; valid: exactly "
                          "one of them (budget.tokens=null for a ratio budget)")
    check_value("budget.ratio", ratio)
    if budget.get("label") != ratio_label(ratio):  # e.g. +budget.ratio on a token budget file: label "none"
        raise ConfigError(f"budget.label={budget.get('label')!r} is not valid for budget.ratio={ratio}; valid: "
                          f"{ratio_label(ratio)!r} (start from a ratio budget: budget=r0.25 budget.ratio={ratio})")


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


def check_run_config(cfg: DictConfig, runs_here: bool = True) -> None:
    """The configuration check of a run: top-level values, the model entry, the task (built, not loaded),
    the device (`runs_here`: the run executes on this machine, not on a SLURM node), the Hub when something
    must be downloaded, and W&B logging. Raises ConfigError (a ValueError) with the valid choices."""
    from hydra.utils import instantiate

    from keydiff.models import ModelConfig
    from keydiff.run import tracking

    for key in (key for key in VALUES if not key.startswith("budget.")):  # the budget's: check_budget_config
        if (value := OmegaConf.select(cfg, key, default=_ABSENT)) is not _ABSENT:  # absent: the run's default
            check_value(key, value)
    if cfg.get("batch_size", 1) > 1 and cfg.get("experiment_name") in LATENCY_EXPERIMENTS:
        raise ConfigError(f"batch_size={cfg.batch_size} is not valid for experiment={cfg.experiment_name}: latency "
                          "experiments time each sample alone; valid: batch_size=1")
    if cfg.policy.name != "full":
        check_budget_config(cfg.budget)
    try:
        parse_shard(cfg.get("shard"))
    except ValueError as error:
        raise ConfigError(str(error)) from None
    check_results_root(cfg.results_root)

    model_cfg = ModelConfig.from_dict(OmegaConf.to_container(cfg.model, resolve=True))
    model_cfg.validate()
    task = instantiate(cfg.task, _convert_="all")
    task.validate()
    task.check_model(model_cfg.max_length)
    check_protocol(cfg.get("query_aware", True), task, cfg.get("batch_size", 1))
    check_batch_invariant(cfg, model_cfg)
    if not cfg.get("dry_run", False):  # a dry run downloads and logs nothing
        if runs_here:
            check_device(model_cfg)
        check_hub_downloads(model_cfg, task)
        tracking.check(cfg)


# Every conf/policy preset's needs (keydiff.policies.capabilities), read as data: importing the policies needs torch.
CAPABILITIES = Path(__file__).resolve().parents[1] / "policies" / "capabilities.json"
POLICY_PRESETS = Path(__file__).resolve().parents[2] / "conf" / "policy"


@functools.lru_cache(maxsize=None)
def batch_invariant_policies() -> tuple[str, ...]:
    """The presets declaring Needs.batch_invariant in keydiff/policies/capabilities.json (a preset the file lacks is
    computed, importing the policies, which needs torch)."""
    import json

    table = json.loads(CAPABILITIES.read_text(encoding="utf-8"))
    if any(path.stem not in table and path.stem != "custom" for path in POLICY_PRESETS.glob("*.yaml")):
        from keydiff.policies.capabilities import completed

        table = completed(table)
    return tuple(sorted({row["policy"] for row in table.values() if row["batch_invariant"]}))


def check_batch_invariant(cfg: DictConfig, model_cfg) -> None:
    """batch_invariant=true: the combinations its kernels cover (keydiff.kernels.batch_invariant), else one line.
    On a CPU it changes nothing (the mode has no CPU kernels), so only the combination is checked."""
    if not cfg.get("batch_invariant", False):
        return
    policy = cfg.policy.name
    if policy not in batch_invariant_policies():
        raise ConfigError(f"batch_invariant=true is not valid with policy={policy}: its scores use reductions the "
                          f"batch-invariant kernels do not cover (valid: {', '.join(batch_invariant_policies())})")
    params = cfg.policy.get("params") or {}
    if params.get("head_budgets", "uniform") != "uniform":
        raise ConfigError("batch_invariant=true is not valid with head-adaptive budgets (policy.params.head_budgets="
                          f"{params.get('head_budgets')}); valid: head_budgets=uniform")
    wrappers = [name for name in ("chunk_length", "critical") if params.get(name)]
    if wrappers:  # ChunkKV's and CriticalKV's scoring is not read for it yet
        raise ConfigError(f"batch_invariant=true is not valid with policy.params.{wrappers[0]} (ChunkKV / CriticalKV "
                          "scoring is not covered); valid: without it")
    if model_cfg.attn_implementation == "flash_attention_2":
        raise ConfigError("batch_invariant=true is not valid with model.attn_implementation=flash_attention_2 (its "
                          "split-KV decoding depends on the batch); valid: sdpa, eager")
    if model_cfg.device == "mps":
        raise ConfigError("batch_invariant=true is not valid with model.device=mps; valid: cuda (cpu: a no-op)")
    if model_cfg.device_map is not None:
        raise ConfigError(f"batch_invariant=true is not valid with model.device_map={model_cfg.device_map}: it runs "
                          "a model on one device; valid: model.device_map=null")


def check_device(model_cfg) -> None:
    """An explicit model.device (cuda, cuda:1, mps) must exist on this machine: refused here, before any run
    directory exists, not when the model loads (torch is imported only for such a device)."""
    if model_cfg.device in ("auto", "cpu"):
        return
    import torch

    cuda = [f"cuda:{i}" for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    here = ["auto", "cpu"] + (["cuda", *cuda] if cuda else []) + (["mps"] if torch.backends.mps.is_available() else [])
    if model_cfg.device not in here:
        what = "no MPS device" if model_cfg.device == "mps" else f"{len(cuda)} CUDA device(s)"
        raise ConfigError(f"model.device={model_cfg.device} is not available on this machine ({what}); "
                          f"valid here: {', '.join(here)}")


def limit_covers_task(cfg: DictConfig) -> bool:
    """Whether task.limit selects every sample of the task (compared by sample ids, whatever limit means for the
    task); False when the data cannot be listed here."""
    from hydra.errors import HydraException
    from hydra.utils import instantiate

    if cfg.task.get("limit") is None:
        return False
    try:
        limited = [sample.id for sample in instantiate(cfg.task, _convert_="all").samples()]
        whole = instantiate(cfg.task, limit=None, _convert_="all")
        if whole.hub_downloads() and hub_unreachable():
            return False
        first = [sample.id for sample in itertools.islice(whole.samples(), len(limited) + 1)]  # never all of a big task
    except (OSError, ValueError, ImportError, RuntimeError, HydraException):  # e.g. data not here, a task without limit
        return False
    return len(first) == len(limited) and set(first) == set(limited)


def drop_whole_task_limit(cfg: DictConfig) -> bool:
    """Set task.limit to null in `cfg` when it covers the whole task, so that the run goes to the whole run's
    directory (`seed0`, not `seed0-limit99`) and reuses what it holds; True if it did."""
    if not limit_covers_task(cfg):
        return False
    limit = cfg.task.limit
    with read_write(cfg), open_dict(cfg), read_write(cfg.task), open_dict(cfg.task):
        cfg.task.limit = None
    log.info("task.limit=%s covers every sample of task %s: this is the whole run (%s)", limit, cfg.task.get("name"),
             run_dir_of(cfg))
    return True


def check_protocol(query_aware: bool, task: Any, batch_size: int = 1) -> None:
    """query_aware=false needs a task whose prompt splits into context and question (`Task.context_split`); a
    shared-context `mode` (keydiff.run.shared) needs query_aware=false and batch_size=1."""
    mode = getattr(task, "mode", "independent")
    if mode != "independent" and query_aware:
        raise ConfigError(f"query_aware=true is not valid with task.mode={mode}: the context is compressed once, "
                          "before any question (valid: query_aware=false, or task.mode=independent to compress each question "
                          "with the context)")
    if mode != "independent" and batch_size != 1:
        raise ConfigError(f"batch_size={batch_size} is not valid with task.mode={mode}: a context's questions share "
                          "one prefill, one context at a time (valid: batch_size=1)")
    if not query_aware and getattr(task, "context_split", None) is None:
        raise ConfigError(f"query_aware=false is not valid for task {task.name!r}: its prompt has no context apart from "
                          "its question to compress (valid: query_aware=true; tasks with a split: ruler_*, longbench*, "
                          "niah*, phonebook)")


HUB_PROBE_SECONDS = 4.0  # how long the Hub may take to answer before it counts as unreachable


@functools.lru_cache(maxsize=None)
def hub_unreachable() -> str | None:
    """Why the Hugging Face Hub cannot be used now (HF_HUB_OFFLINE=1, or HF_ENDPOINT does not answer), or
    None. Asked once per process, and only for a run that would download something."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE=1"
    return probe_endpoint(constants.ENDPOINT)


def probe_endpoint(endpoint: str, timeout: float = HUB_PROBE_SECONDS) -> str | None:
    """None if `endpoint` answers an HTTP request within `timeout` seconds (any status), else why not: one request
    with a hard limit (in a thread, so a hanging DNS lookup counts) instead of huggingface_hub's long retries."""
    endpoint = endpoint.rstrip("/")
    outcome: list[str | None] = []

    def probe() -> None:
        try:
            urllib.request.urlopen(urllib.request.Request(f"{endpoint}/api/models?limit=1", method="HEAD"),
                                   timeout=timeout).close()
            outcome.append(None)
        except urllib.error.HTTPError:  # it answered (401, 404, 429 ...): reachable
            outcome.append(None)
        except (urllib.error.URLError, OSError, ValueError) as error:
            reason = getattr(error, "reason", error)
            # A TLS failure means a server answered; the Hub's own client (its CA bundle) may well succeed.
            outcome.append(None if isinstance(reason, ssl.SSLError) else f"{endpoint} did not answer: {reason}")

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(timeout + 0.5)
    return outcome[0] if outcome else f"{endpoint} did not answer within {timeout:g} s"


def model_needs_hub(model_cfg) -> bool:
    """A Hub id whose config.json is not in the local Hugging Face cache (a download would be needed)."""
    if not model_cfg.is_hub_id:
        return False
    from huggingface_hub import try_to_load_from_cache

    cached = try_to_load_from_cache(model_cfg.path, "config.json", revision=model_cfg.revision)
    return not isinstance(cached, str)


def check_hub_downloads(model_cfg, task) -> None:
    """Fail in seconds, naming the offline alternatives, when the run must download from an unreachable Hub
    (before any directory exists, instead of a minute of retries and a traceback after it)."""
    from huggingface_hub import constants

    needs = []
    if model_needs_hub(model_cfg):
        needs.append(f"model.path={model_cfg.path}, not in the Hugging Face cache {constants.HF_HUB_CACHE} "
                     "(offline: model.path=<folder with config.json, weights and tokenizer>, or HF_HOME=<a cache "
                     "filled where the Hub is reachable> with HF_HUB_OFFLINE=1)")
    needs += task.hub_downloads()
    if not needs:
        return
    reason = hub_unreachable()
    if reason is not None:
        raise ConfigError(f"the Hugging Face Hub is not reachable ({reason}); this run needs it for {'; '.join(needs)}")


def describe_error(error: BaseException) -> str:
    """One line for a user error: an unknown config choice lists the valid ones, anything else its message."""
    from hydra.errors import MissingConfigException

    if isinstance(error, MissingConfigException) and error.options and error.missing_cfg_file:
        group, _, name = str(error.missing_cfg_file).rpartition("/")
        return f"{group}={name} is not valid; valid: {', '.join(sorted(error.options))}"
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    return " | ".join(lines[:6]) if lines else type(error).__name__


# Hydra launcher configs that conf/hydra/launcher/*.yaml build on -> the plugin module providing them (the 'slurm'
# extra). Without the plugin Hydra only says that it "could not load" the config.
LAUNCHER_PLUGINS = {"submitit_slurm": "hydra_plugins.hydra_submitit_launcher",
                    "submitit_local": "hydra_plugins.hydra_submitit_launcher",
                    "joblib": "hydra_plugins.hydra_joblib_launcher"}


def missing_launcher(error: BaseException) -> str | None:
    """The one line for a Hydra error caused by a launcher whose plugin is not installed, naming the extra; else None."""
    failed = re.search(r"Could not load 'hydra/launcher/([\w-]+)'", str(error))
    plugin = LAUNCHER_PLUGINS.get(failed[1]) if failed else None
    if plugin is None or extras.installed(plugin):
        return None
    asked = re.search(r"In 'hydra/launcher/([\w-]+)'", str(error))  # conf/hydra/launcher/slurm.yaml builds on it
    what = f"hydra/launcher={asked[1]} (Hydra's {failed[1]} launcher)" if asked else f"Hydra's {failed[1]} launcher"
    return str(extras.missing("slurm", what, plugin))


# Hydra's own command-line flags other than -m: with any of them run.py leaves the command line to Hydra.
RUN_FLAGS = ("-m", "--multirun")


def group_options(conf_dir: Path, group: str) -> list[str]:
    return sorted(path.stem for path in (conf_dir / group).glob("*.yaml"))


def check_group_choice(conf_dir: Path, group: str, value: Any) -> None:
    """Refuse a group value Hydra would refuse without listing the names, naming them and how to give any token
    count or ratio: a number (`budget=2048`: Hydra's traceback) or a ratio no budget file names (`budget=r0.3`)."""
    if value is None or isinstance(value, list):
        return
    ratio = re.fullmatch(r"r(\d*\.?\d+)", value) if group == "budget" and isinstance(value, str) else None
    options = group_options(conf_dir, group)
    if isinstance(value, str) and (ratio is None or value in options):
        return  # a name: Hydra lists the names when no file has it
    hint = f", or any ratio: budget=r0.25 budget.ratio={ratio[1]}" if ratio else ""
    if group == "budget" and not ratio:
        tokens = value if _positive(value) else None
        named = f"{tokens // 1024}k" if tokens and tokens % 1024 == 0 and f"{tokens // 1024}k" in options else None
        hint = (f", or a token count: budget.tokens={tokens if tokens else '<positive integer>'}"
                + (f" (the same as budget={named})" if named else ""))
    raise ConfigError(f"{group}={value} is not valid; valid: {', '.join(options)}{hint}")


def policy_parameters_of(policy: DictConfig) -> list[str] | None:
    """The parameters the configured policy takes (keydiff.policies.policy_parameters; imports torch, so only for
    an error's message), or None when its class cannot be imported here."""
    from keydiff.policies import policy_class, policy_parameters

    try:
        return policy_parameters(policy_class(policy.get("target") or policy.name))
    except ValueError:
        return None


def unlisted_parameter(cfg: DictConfig, key: str) -> tuple[bool, list[str] | None]:
    """(whether `key` is right but must be added with `+` because no config file lists it, the policy's parameters
    when `key` is a policy parameter): a parameter of the policy (`policy=custom` lists none; one whose class is not
    importable here is checked when the run is planned), or a model setting a model file leaves out (`model.device_map`)."""
    from keydiff.models import ModelConfig

    parts = key.split(".")
    if len(parts) == 3 and parts[:2] == ["policy", "params"]:
        valid = policy_parameters_of(cfg.policy)
        return valid is None or parts[2] in valid, valid
    return len(parts) == 2 and parts[0] == "model" and parts[1] in ModelConfig.__dataclass_fields__, None


def unknown_key(conf_dir: Path, config_name: str, key: str, overrides: list[str], line: str | None = None) -> str:
    """The one line for an override of a key not in the configuration (`polcy=tova`): the valid groups and keys at
    the typo's level; a valid but unlisted key (`policy.params.alpha` of your own policy) is told to add `+`."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(str(conf_dir), version_base="1.3"):
        cfg = compose(config_name, overrides=overrides)
    parts, node, known = key.split("."), cfg, []
    for part in parts[:-1]:
        if not isinstance(node, DictConfig) or part not in node:
            break
        node, known = node[part], known + [part]
    where = ".".join(known)
    keys = sorted(str(k) for k in node.keys()) if isinstance(node, DictConfig) else []
    typo = ".".join(known + [parts[len(known)]])
    if not known:
        groups = sorted(p.name for p in conf_dir.iterdir() if p.is_dir() and p.name != "hydra" and any(p.glob("*.yaml")))
        return (f"{typo} is not a config group or key; valid groups: {', '.join(groups)}; valid keys: "
                f"{', '.join(k for k in keys if k not in groups)}")
    if typo != key:
        return f"{typo} is not a key of {where}; valid: {', '.join(keys) or 'none'}"
    unlisted, parameters = unlisted_parameter(cfg, key)
    if unlisted:
        return (f"{key} is not a key of {where}; valid: {', '.join(keys) or 'none'} (a key no config file lists is "
                f"added with +: +{line or key + '=<value>'})")
    if parameters is not None:
        return (f"{key} is not a parameter of policy {cfg.policy.get('target') or cfg.policy.name}; valid: "
                f"{', '.join(parameters)} (add one its config does not list with +: +{where}.<name>=<value>)")
    return f"{typo} is not a key of {where}; valid: {', '.join(keys) or 'none'}"


def check_command_line(argv: Sequence[str], conf_dir: str | os.PathLike, config_name: str = "config") -> None:
    """Compose the configuration from the command line as Hydra will, before Hydra does, so an unknown choice or
    key, or a number given to a group (`budget=2048`), is one line and exit status 2. Sweep values are checked
    as names here and composed point by point by the sweeper; other Hydra flags (--cfg, --help, ...) go to Hydra."""
    from hydra import compose, initialize_config_dir
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import Transformer, ValueType
    from hydra.errors import HydraException

    if any(arg.startswith("-") and arg not in RUN_FLAGS for arg in argv):
        return
    conf_dir = Path(conf_dir).absolute()
    multirun = any(arg in RUN_FLAGS for arg in argv)
    arguments = [arg for arg in argv if arg not in RUN_FLAGS]
    try:
        overrides = OverridesParser.create().parse_overrides(arguments)
        for override in overrides:
            group = override.key_or_group
            if override.is_delete() or not (conf_dir / group).is_dir() or override.value_type in (
                    ValueType.GLOB_CHOICE_SWEEP, ValueType.INTERVAL_SWEEP):  # names only, or for other sweepers
                continue
            values = (override.sweep_iterator(transformer=Transformer.identity) if override.is_sweep_override()
                      else [override.value()])
            for value in values:
                check_group_choice(conf_dir, group, value)
        sweeps = [o.input_line for o in overrides if o.is_sweep_override()]
        fixed = [o.input_line for o in overrides if not o.is_sweep_override()]  # as Hydra composes a sweep
        with initialize_config_dir(str(conf_dir), version_base="1.3"):
            cfg = compose(config_name, overrides=fixed, return_hydra_config=True)
    except (HydraException, ValueError) as error:
        missing = re.match(r"Could not override '([^']+)'", str(error))
        if missing and not missing[1].startswith("hydra."):
            rest = [o for o in fixed if o.split("=", 1)[0] != missing[1]]
            line = next((o for o in fixed if o.split("=", 1)[0] == missing[1]), None)
            try:
                exit_with_error(unknown_key(conf_dir, config_name, missing[1], rest, line))
            except (HydraException, ValueError):
                pass  # the other overrides fail too: Hydra's message below
        exit_with_error(missing_launcher(error) or describe_error(error))
    for override in overrides:  # a swept key is composed point by point later: a typo in a plain key is caught here
        key = override.key_or_group
        if (override.is_sweep_override() and override.package is None and not override.is_add()
                and not override.is_force_add() and not override.is_delete() and not key.startswith("hydra")
                and not (conf_dir / key.split(".")[0]).is_dir() and OmegaConf.select(cfg, key, default=_ABSENT) is _ABSENT):
            exit_with_error(unknown_key(conf_dir, config_name, key, fixed, override.input_line))
    if sweeps and not multirun and str(cfg.hydra.get("mode")) != "RunMode.MULTIRUN":  # an experiment may sweep
        exit_with_error(f"{sweeps[0]} lists several values: add -m to run one job per value (a sweep), or write "
                        "key=[a,b] for a list, key='a,b' for a string")


def _check_single_run(config: DictConfig) -> None:
    """Hydra callback body for a single run: the checks (and dry_run) before Hydra creates the run directory."""
    try:
        check_run_config(config)
        drop_whole_task_limit(config)  # Hydra's run directory comes from this config: the whole run's
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
        try:
            _check_single_run(config)
        except Exception:  # Hydra only warns about a callback's error and starts the run unchecked: stop here
            log.exception("the configuration check failed; nothing was run")
            raise SystemExit(1) from None
