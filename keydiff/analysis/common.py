"""What the analysis entry points share: the Hydra config (conf/analysis.yaml), checks, prompts, provenance, saving.

Prompts are real text: non-overlapping windows of the NIAH haystack prose (the default, offline), or
LongBench prompts built by the longbench task (template, chat template, middle truncation to `length`).
"""

from __future__ import annotations

import platform
from pathlib import Path
from typing import Any

import torch
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf

from keydiff.analysis.statistics import ATTENTION_TARGETS
from keydiff.bench.common import CHECKOUT
from keydiff.models import ModelConfig, model_provenance
from keydiff.policies import build_policy
from keydiff.policies.keydiff import ANCHORS
from keydiff.tasks.haystack import HAYSTACK_SOURCES

SOURCES = ("haystack", "longbench")
STYLE = {"svg.hashsalt": "keydiff", "font.size": 8, "axes.titlesize": 9, "figure.dpi": 100, "savefig.dpi": 150}


def load_config(overrides: list[str]) -> DictConfig:
    """conf/analysis.yaml with command-line overrides (`model=...`, `length=4096`, `data.source=longbench`)."""
    with initialize_config_dir(config_dir=str(CHECKOUT / "conf"), version_base="1.3"):
        return compose(config_name="analysis", overrides=overrides)


def check_config(cfg: DictConfig, eviction: bool) -> ModelConfig:
    """Every value checked before the model is loaded; errors name the key and the valid choices."""
    def positive(key: str) -> None:
        value = OmegaConf.select(cfg, key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{key} must be a positive integer, got {value!r}")

    for key in ("length", "samples", "window"):
        positive(key)
    if cfg.data.source not in SOURCES:
        raise ValueError(f"data.source {cfg.data.source!r} is not valid; valid: {', '.join(SOURCES)}")
    source = cfg.data.get("haystack_source", "pinned")
    if source not in HAYSTACK_SOURCES:
        raise ValueError(f"data.haystack_source {source!r} is not valid; valid: {', '.join(HAYSTACK_SOURCES)}")
    if cfg.anchor not in ANCHORS:
        raise ValueError(f"anchor {cfg.anchor!r} is not valid; valid: {', '.join(ANCHORS)}")
    if cfg.attention not in ATTENTION_TARGETS:
        raise ValueError(f"attention {cfg.attention!r} is not valid; valid: {', '.join(ATTENTION_TARGETS)}")
    if cfg.logdet_ridge < 0:
        raise ValueError(f"logdet_ridge must be >= 0, got {cfg.logdet_ridge}")
    bad_formats = [f for f in cfg.formats if f not in ("png", "pdf")]
    if bad_formats or not cfg.formats:
        raise ValueError(f"formats must be a non-empty list of png / pdf, got {OmegaConf.to_container(cfg.formats)}")
    if cfg.heads is not None and not all(len(pair) == 2 for pair in cfg.heads):
        raise ValueError(f"heads must be a list of [layer, kv_head] pairs, got {OmegaConf.to_container(cfg.heads)}")
    if eviction:
        positive("cache_budget")
        positive("block_size")
        if cfg.cache_budget >= cfg.length:
            raise ValueError(f"cache_budget ({cfg.cache_budget}) must be smaller than length ({cfg.length}), "
                             "or nothing is evicted")
        for name in cfg.policies:
            build_policy(name).validate(cfg.cache_budget)  # unknown names list the valid policies
    model_cfg = ModelConfig.from_dict(OmegaConf.to_container(cfg.model, resolve=True))
    model_cfg.validate()
    return model_cfg


def config_from_command_line(argv: list[str], eviction: bool) -> tuple[DictConfig, ModelConfig]:
    """`load_config` + `check_config` for an entry point: a bad value stops it with a one-line error
    (naming the key and the valid choices) before any model is loaded."""
    cfg = load_config(argv)
    try:
        return cfg, check_config(cfg, eviction)
    except ValueError as error:
        raise SystemExit(f"error: {error}") from None


def haystack_prompts(cfg: DictConfig, tokenizer) -> tuple[list[tuple[str, torch.Tensor]], dict[str, Any]]:
    """`samples` non-overlapping windows of `length` tokens of the haystack prose, each led by BOS if any."""
    from keydiff.tasks.haystack import load_haystack

    haystack = load_haystack(cfg.data.haystack_dir, cfg.data.get("haystack_source", "pinned"))
    ids = tokenizer(haystack.text, add_special_tokens=False)["input_ids"]
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    body = cfg.length - len(bos)
    available = len(ids) // body
    if available < cfg.samples:
        raise ValueError(f"the haystack holds {len(ids)} tokens: at most {available} samples of length {cfg.length}")
    prompts = [(f"haystack/{i * body}", torch.tensor(bos + ids[i * body : (i + 1) * body])) for i in range(cfg.samples)]
    return prompts, {"source": "haystack",
                     "description": haystack_label(cfg.data.haystack_dir, haystack.sources, haystack.kind),
                     "sources": haystack.sources}


def haystack_label(haystack_dir: str | None, sources: dict[str, str], kind: str = "txt_dir") -> str:
    """The haystack named by what it is, not where it lies: the pinned pydoc prose, or this interpreter's
    pydoc_data.topics (with its Python version); RULER's essay file by name; a .txt folder by name and file count
    (hashes in `sources`). `kind`: Haystack.kind."""
    if haystack_dir is None and kind == "pydoc_pinned":
        return "pydoc_data.topics prose (pinned, CPython 3.11.7)"
    if haystack_dir is None:
        return f"pydoc_data.topics prose (Python {platform.python_version()})"
    if kind == "ruler_json":
        return "RULER's " + ", ".join(name.rpartition("/")[2] for name in sources)
    return f"{len(sources)} .txt file(s) of folder '{Path(str(haystack_dir)).expanduser().resolve().name}'"


def prompt_source(data: dict[str, Any]) -> str:
    """One line for titles: "LongBench narrativeqa" or the haystack label."""
    return f"LongBench {data['dataset']}" if data["source"] == "longbench" else data["description"]


def figure_title(cfg: DictConfig, data: dict[str, Any], prompts: int, budget: bool = True) -> str:
    """What an analysis figure measured: model, prompt source, prompts x length (and budget, block size)."""
    title = f"{cfg.model.name}; {prompt_source(data)}; {prompts} prompt(s) of {cfg.length} tokens"
    return title + (f"; budget N = {cfg.cache_budget}, B = {cfg.block_size}" if budget else "")


def titled(fig, title: str):
    """Put `title` above the figure's own suptitle (if any), wrapped to the figure's width."""
    import textwrap

    own = fig.get_suptitle()
    title = textwrap.fill(title, width=max(40, int(fig.get_figwidth() * 15)))  # ~15 characters per inch at 7 pt
    fig.suptitle(f"{title}\n{own}" if own else title, fontsize=7)
    return fig


def longbench_prompts(cfg: DictConfig, tokenizer, dataset: str):
    """The first `samples` prompts of a LongBench dataset, as the longbench task builds them."""
    from keydiff.tasks.longbench import LongBench

    task = LongBench(datasets=[dataset], data_dir=cfg.data.longbench_dir, limit=cfg.samples)
    task.validate()
    prompts = [(sample.id, torch.tensor(task.build_prompt(sample, tokenizer, cfg.length).input_ids))
               for sample in task.samples()]
    if not prompts:
        raise ValueError(f"LongBench {dataset} has no samples")
    return prompts, {"source": "longbench", "dataset": dataset, "sources": task.data_sources()}


def prompts(cfg: DictConfig, tokenizer, default_dataset: str):
    if cfg.data.source == "longbench":
        return longbench_prompts(cfg, tokenizer, cfg.data.dataset or default_dataset)
    return haystack_prompts(cfg, tokenizer)


def inputs_record(cfg: DictConfig, model_cfg: ModelConfig, model, data: dict[str, Any], prompt_list,
                  outputs) -> dict[str, Any]:
    """What an analysis ran on, beside the shared provenance record (keydiff.bench.common.provenance:
    command, code, packages, environment, times): the resolved config, the model, the data (with hashes
    and each sample's length), the device and the files written."""
    return {
        "config": OmegaConf.to_container(cfg, resolve=True),
        "model": model_provenance(model_cfg, model),
        "data": {**data, "samples": [{"id": sid, "tokens": int(ids.numel())} for sid, ids in prompt_list]},
        "device": str(next(model.parameters()).device),
        "outputs": [str(p) for p in outputs],
    }


def save_figure(fig, out: Path, name: str, formats=("png", "pdf")) -> list[Path]:
    """PNG / PDF without the timestamps and version strings matplotlib would embed."""
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for ext in formats:
        metadata = {"Software": None} if ext == "png" else {"Creator": None, "Producer": None, "CreationDate": None}
        paths.append(out / f"{name}.{ext}")
        fig.savefig(paths[-1], metadata=metadata)
    plt.close(fig)
    return paths
