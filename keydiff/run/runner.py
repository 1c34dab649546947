"""One run: check everything, load the model, prefill + decode every sample, write the results.

Order matters: every configuration error (policy, budget, block size, task, model) is raised before the
model is loaded, so a typo in a sweep fails in a second rather than after minutes of loading. The
configuration is checked once (keydiff.run.checks.check_run_config: by run.py's Hydra callback or sweeper,
or here for API callers); `plan_run` adds what needs the policy classes.

A run survives what a cluster does to it:
  * a sample that runs out of memory (CUDA OOM, or a prompt over `max_prompt_tokens`) is written as a
    failed row (status, failure_reason, prompt_tokens), memory is released and the run goes on; a re-run
    skips recorded failures unless `retry_failed=true`. Any other error stops the run naming the sample.
  * SIGTERM / SIGUSR1 / SIGUSR2 abandon the current sample and stop after writing the summary
    (keydiff.run.preemption); the next start resumes.
  * one process writes a run directory at a time (keydiff.run.lock; taken once: here, or by run.py before
    it imports torch).
  * each invocation that writes rows names itself on them and in summary.json's `invocations` (command, batch
    size, threads, commit, wall time: keydiff.run.invocations); one that finds nothing to do changes only the
    summary's `last_checked_at`.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import logging
import math
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from keydiff.engine import check_budget, generate, prefill, resolve_block_size
from keydiff.models import ModelConfig, eos_token_ids, load_model, model_provenance
from keydiff.policies import Policy, build_policy
from keydiff.run import invocations, memory, shards, tracking
from keydiff.run.checks import check_run_config
from keydiff.run.lock import RunLock
from keydiff.run.preemption import Preempted, StopSignals
from keydiff.run.provenance import code_label, provenance_record, timestamp
from keydiff.run.results import ResultStore, is_failed, succeeded
from keydiff.tasks.base import Prompt, Task

log = logging.getLogger(__name__)
# Keys that do not change what a run computes, so changing them never blocks resuming a run directory.
# (max_prompt_tokens only decides which samples are recorded as failed; failures are counted in the summary.)
# (shard only selects which of the grid point's samples a directory holds: every shard records the grid point's
# configuration, keydiff.run.shards.)
NON_RESULT_KEYS = ("overwrite", "logger", "results_root", "experiment_name", "run_subdir", "slurm", "threads",
                   "batch_size", "max_prompt_tokens", "retry_failed", "lock_wait", "dry_run", "only_missing",
                   "shard")


@dataclass
class RunPlan:
    """Everything checked and built before the model is loaded."""

    policy_name: str
    policy_params: dict[str, Any]
    budget: int | None
    block_size: int | None
    statistics: str
    decode_eviction: bool
    task: Task
    model_cfg: ModelConfig
    ratio: float | None = None  # a ratio budget (budget.ratio): N is set per sample from its prompt length
    # False: kvpress's query-agnostic protocol (the context compressed, the question held: engine's held_suffix)
    query_aware: bool = True

    def new_policy(self) -> Policy:
        """A fresh policy per sample, so stateful policies (random) do not depend on sample order."""
        return build_policy(self.policy_name, **self.policy_params)

    @property
    def evicts(self) -> bool:
        return self.budget is not None or self.ratio is not None

    def build_prompt(self, sample, tokenizer) -> Prompt:
        """The task's prompt for this protocol (query_aware=False asks the task for its context/question split)."""
        extra = {} if self.query_aware else {"query_aware": False}
        return self.task.build_prompt(sample, tokenizer, self.model_cfg.max_length, **extra)

    def compressed_tokens(self, prompt: Prompt) -> int:
        """The tokens eviction sees, what a ratio budget counts: the prompt, or its context (query_aware=False)."""
        return len(prompt.input_ids) if prompt.context_tokens is None else prompt.context_tokens

    def sample_budget(self, prompt_tokens: int) -> int | None:
        """N for a prompt of this length: the token budget, or ceil(ratio x prompt tokens), at least 1."""
        if self.ratio is None:
            return self.budget
        return max(1, math.ceil(self.ratio * prompt_tokens))


def plan_run(cfg: DictConfig) -> RunPlan:
    """Build the run from a configuration that passed check_run_config, without loading the model: adds the
    checks that need the policy classes (parameters, budget). Raises ValueError with valid choices."""
    raw = cfg.policy.get("params")
    params = OmegaConf.to_container(raw, resolve=True) if raw is not None else {}
    policy_name = policy_target(cfg.policy)
    policy = build_policy(policy_name, **params)
    # A ratio budget's N is known per sample only: the policy's own constraints are checked against each
    # sample's N (process_sample records a sample whose N they refuse as failed, "budget_too_small").
    ratio = cfg.budget.get("ratio") if policy.evicts else None
    budget = cfg.budget.tokens
    if ratio is None:
        check_budget(policy, budget)
    block_size = resolve_block_size(cfg.block_size)
    task = instantiate(cfg.task, _convert_="all")
    model_cfg = ModelConfig.from_dict(OmegaConf.to_container(cfg.model, resolve=True))
    return RunPlan(policy_name, params, int(budget) if policy.evicts and ratio is None else None, block_size,
                   cfg.attention_statistics, cfg.get("decode_eviction", True), task, model_cfg,
                   None if ratio is None else float(ratio), bool(cfg.get("query_aware", True)))


def policy_target(policy_cfg: DictConfig) -> str:
    """What build_policy gets: the built-in name, or for `policy=custom` the class path in `policy.target`."""
    target = policy_cfg.get("target")
    if policy_cfg.name == "custom" and not target:
        raise ValueError("policy=custom needs policy.target=<module>.<Class>, e.g. policy.target=my_lab.policies.MyPolicy")
    return target or policy_cfg.name


def result_config(cfg: DictConfig) -> dict[str, Any]:
    """The part of the config that determines the results (what a resumed run must match).

    task.limit stays in: ResultStore lets a larger limit extend a run and refuses a smaller one.
    """
    data = OmegaConf.to_container(cfg, resolve=True)
    for key in NON_RESULT_KEYS:
        data.pop(key, None)
    return data


def set_threads(threads: int | None) -> int:
    """torch's intra-op threads from the `threads` key (default: SLURM_CPUS_PER_TASK); returns the count used."""
    if threads:
        torch.set_num_threads(int(threads))
    return torch.get_num_threads()


def derived_seed(run_seed: int, sample_id: str) -> int:
    digest = hashlib.sha256(f"{run_seed}:{sample_id}".encode()).hexdigest()
    return int(digest[:12], 16)


def cuda_devices(model: torch.nn.Module) -> list[torch.device]:
    """The CUDA devices holding the model's parameters (several when model.device_map spreads it over GPUs)."""
    return sorted({p.device for p in model.parameters() if p.device.type == "cuda"}, key=str)


def peak_memory_bytes(device: torch.device, devices: list[torch.device] | None = None) -> int:
    """Peak GPU memory allocated during the sample on CUDA, summed over `devices` (default: `device`); the
    process's own peak RSS on CPU (VmHWM: keydiff.run.memory says why not ru_maxrss)."""
    if device.type == "cuda":
        return int(sum(torch.cuda.max_memory_allocated(d) for d in (devices or [device])))
    return memory.peak_rss_bytes()


def kv_bytes_per_layer_entry(model: torch.nn.Module) -> int:
    """Bytes one cached token costs in one layer (keys + values, every KV head)."""
    config = model.config.get_text_config()
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    itemsize = next(model.parameters()).element_size()
    return 2 * config.num_key_value_heads * head_dim * itemsize


def is_out_of_memory(error: BaseException) -> bool:
    """CUDA OOM, a Python MemoryError, or a RuntimeError of an allocator that ran out (CPU, MPS, HIP)."""
    if isinstance(error, (torch.cuda.OutOfMemoryError, MemoryError)):
        return True
    text = str(error).lower()
    return isinstance(error, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text)


def release_memory() -> None:
    """Free what an abandoned sample held (its cache, activations) before the next one starts."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


_LOADED: dict[str, Any] = {}  # the last loaded model, reused by the next run of a sweep in this process


def load_model_once(model_cfg: ModelConfig):
    """Load the model, reusing the previous run's if its configuration is identical (sequential sweeps)."""
    key = repr(model_cfg)
    if _LOADED.get("key") != key:
        _LOADED.clear()  # drop the old model before loading the next one
        _LOADED.update(key=key, value=load_model(model_cfg))
    return _LOADED["value"]


def warm_up(plan: RunPlan, model, tokenizer, sample) -> None:
    """One untimed prefill + decode on the start of the first prompt, so that no sample's TTFT carries the
    device's start-up (CUDA context, cuBLAS handles, kernel selection, allocator growth)."""
    prompt = plan.build_prompt(sample, tokenizer)
    ids = prompt.input_ids
    tokens = min(len(ids), 2 * (plan.block_size or 128))
    policy = plan.new_policy()
    budget = plan.sample_budget(plan.compressed_tokens(prompt))  # the first sample's N: what that sample will run
    if budget is not None and plan.ratio is not None:
        try:
            policy.check(budget)
        except ValueError:
            return  # that sample is recorded as failed; nothing to warm up
    state = prefill(model, torch.tensor([ids[:tokens]]), policy, budget, plan.block_size, plan.statistics,
                    tokenizer=tokenizer)
    generate(model, state, 2, evict=plan.decode_eviction)


def run_sample(
    plan: RunPlan, model, tokenizer, stop_ids: list[int], sample, run_seed: int, code: str | None = None,
    prompt: Prompt | None = None,
) -> dict[str, Any]:
    prompt = prompt or plan.build_prompt(sample, tokenizer)
    settings = prompt.generation
    device = next(model.parameters()).device
    for gpu in cuda_devices(model):
        torch.cuda.reset_peak_memory_stats(gpu)
    state, budget = prefill_sample(plan, model, tokenizer, prompt)
    seed = sample_seed(settings, run_seed, sample)
    out = generate(model, state, **decode_settings(plan, stop_ids, settings, seed))
    return sample_row(plan, model, tokenizer, sample, prompt, state, out, budget, seed, code)


def prefill_sample(plan: RunPlan, model, tokenizer, prompt: Prompt):
    """The sample's block-wise prefill with a fresh policy and its own N: (PrefillResult, budget)."""
    compressed = plan.compressed_tokens(prompt)
    held = len(prompt.input_ids) - compressed  # the question, held whole up to the first token (query_aware=False)
    budget = plan.sample_budget(compressed)
    state = prefill(model, torch.tensor([prompt.input_ids], dtype=torch.long), plan.new_policy(), budget,
                    plan.block_size, plan.statistics, tokenizer=tokenizer, held_suffix=held)
    return state, budget


def sample_seed(settings, run_seed: int, sample) -> int:
    """The task's seed for this sample, else one derived from the run seed and the sample id."""
    return settings.seed if settings.seed is not None else derived_seed(run_seed, sample.id)


def decode_settings(plan: RunPlan, stop_ids: list[int], settings, seed: int) -> dict[str, Any]:
    """keydiff.generate's arguments for a sample (keydiff.batching.Request takes the same)."""
    return dict(max_new_tokens=settings.max_new_tokens, eos_token_ids=list(stop_ids) + list(settings.stop_token_ids),
                do_sample=settings.do_sample, temperature=settings.temperature, top_p=settings.top_p,
                min_new_tokens=settings.min_new_tokens, seed=seed, evict=plan.decode_eviction)


def sample_row(plan: RunPlan, model, tokenizer, sample, prompt: Prompt, state, out, budget: int | None, seed: int,
               code: str | None) -> dict[str, Any]:
    """The result row of a decoded sample (`state`: its prefill, `out`: its one-row GenerationResult)."""
    settings = prompt.generation
    device = next(model.parameters()).device
    tokens = out.token_ids[0]
    prediction = tokenizer.decode(tokens, skip_special_tokens=True)
    length = len(prompt.input_ids)
    compressed = plan.compressed_tokens(prompt)
    held = length - compressed  # the question held whole (query_aware=false), else 0
    # Entries per KV head after prefill (head-adaptive layers: their mean over heads; padding is -1), over the layers
    # the policy bounds (a hybrid model's sliding-window layers hold their window, whatever the budget), of the
    # compressed tokens (a held question is all there, every head).
    bounded = [p for p, kind in zip(state.kept_positions, state.cache.layer_kinds) if kind != "sliding"]
    kept = min(int((positions >= 0).sum()) // (positions.shape[0] * positions.shape[1])
               for positions in bounded or state.kept_positions) - held
    return {
        "sample_id": sample.id,
        "status": "ok",
        "prediction": prediction,
        "scores": plan.task.score(sample, prediction),
        "info": prompt.info,
        "prompt_tokens": length,
        "budget": budget,
        "kept_tokens": kept,
        "compression_ratio": 1.0 if budget is None else min(budget / compressed, 1.0),
        "query_aware": plan.query_aware,
        **({} if plan.query_aware else {"context_tokens": compressed, "held_tokens": held}),
        "ttft_s": state.seconds,
        "decode_s": out.seconds,
        "new_tokens": len(tokens),
        "finish_reason": out.finish_reasons[0],
        "max_cache_entries": out.max_cache_entries,
        # Per layer: its budget N_l (a schedule such as PyramidKV makes them differ) and its peak entries per head.
        "layer_budgets": state.cache.layer_budgets,
        "layer_max_cache_entries": state.cache.layer_max_entries,
        # KVzip's reconstruction passes hold N + B + R + B entries per head while they run (absent for other policies).
        **({"max_scratch_entries": state.max_scratch_entries} if state.max_scratch_entries else {}),
        # Per layer, all KV heads together: the peak entries held and the head count (what bounds a layer whose
        # heads share its budget, AdaKV: kv_heads x (N_l + B)).
        "layer_max_total_entries": state.cache.layer_max_total_entries,
        "layer_kv_heads": state.cache.layer_kv_heads,
        # What the cache's key/value buffers really hold (allocated once per sequence, N + B slots per layer).
        "kv_cache_bytes": state.cache.kv_cache_bytes,
        # Upper bound of the KV entries held at once: every layer's own peak, summed, in bytes.
        "kv_cache_peak_bytes": state.cache.entries_peak_sum * kv_bytes_per_layer_entry(model),
        "peak_memory_bytes": peak_memory_bytes(device, cuda_devices(model)),
        "seed": seed if settings.do_sample else None,
        "code": code,  # commit (+ "-dirty") that produced this row: a resumed run may span commits
    }


def failed_row(plan: RunPlan, sample, prompt: Prompt, reason: str, message: str, code: str | None) -> dict[str, Any]:
    """The row of a sample that could not run: why, and how long its prompt was (no scores)."""
    return {"sample_id": sample.id, "status": "failed", "failure_reason": reason, "error": message[:500],
            "info": prompt.info, "prompt_tokens": len(prompt.input_ids),
            "budget": plan.sample_budget(plan.compressed_tokens(prompt)), "query_aware": plan.query_aware, "code": code}


def process_sample(plan: RunPlan, model, tokenizer, stop_ids, sample, cfg: DictConfig, code, signals) -> dict[str, Any]:
    """Run one sample; out-of-memory and the prompt cap give a failed row, any other error stops the run."""
    out_of_memory = None
    with signals.interruptible():
        prompt, refused = screen_sample(plan, tokenizer, sample, cfg, code)
        if refused is not None:
            return refused
        try:
            return run_sample(plan, model, tokenizer, stop_ids, sample, int(cfg.seed), code, prompt=prompt)
        except Exception as error:  # Preempted is a BaseException and passes through
            if not is_out_of_memory(error):
                raise RuntimeError(f"sample {sample.id!r} failed with {type(error).__name__}: {error}") from error
            out_of_memory = f"{type(error).__name__}: {error}"
    release_memory()  # outside the except block, once the traceback (and the tensors it pins) is gone
    log.warning("sample %s ran out of memory (%d prompt tokens): recorded as failed", sample.id, len(prompt.input_ids))
    return failed_row(plan, sample, prompt, "out_of_memory", out_of_memory, code)


def screen_sample(plan: RunPlan, tokenizer, sample, cfg: DictConfig, code) -> tuple[Prompt, dict[str, Any] | None]:
    """The sample's prompt, and its failed row if it must not run (over max_prompt_tokens, or a ratio budget
    whose N the policy refuses), else None."""
    cap = cfg.get("max_prompt_tokens")
    prompt = plan.build_prompt(sample, tokenizer)
    if cap is not None and len(prompt.input_ids) > cap:
        return prompt, failed_row(plan, sample, prompt, "max_prompt_tokens",
                                  f"prompt has {len(prompt.input_ids)} tokens > max_prompt_tokens={cap}", code)
    budget = plan.sample_budget(plan.compressed_tokens(prompt))
    if plan.ratio is not None and budget is not None:
        try:
            plan.new_policy().check(budget)
        except ValueError as error:  # e.g. a sink or window larger than this short prompt's N
            return prompt, failed_row(plan, sample, prompt, "budget_too_small",
                                      f"budget.ratio={plan.ratio} gives N={budget} for this prompt: {error}", code)
    return prompt, None


def run_statistics(rows: list[dict[str, Any]], plan: RunPlan) -> dict[str, Any]:
    if not rows:
        return {"samples": 0}
    n = len(rows)
    bounded = plan.evicts and plan.block_size is not None and plan.decode_eviction
    peak = max(row["max_cache_entries"] for row in rows)

    def room(row: dict[str, Any]) -> int:
        """Entries a layer may hold over its N_l: a block B, or (query_aware=false) the held question and the
        first generated token, written before the first decoding step's eviction."""
        return max(plan.block_size, row.get("held_tokens", 0) + 1) if row.get("held_tokens") else plan.block_size

    extra = max(room(row) for row in rows) if bounded else None
    # The bound is per layer: N_l + B, with N_l the layer's own budget (uniform unless a schedule is set; a
    # PyramidKV schedule capped by a short prompt may differ between samples, so each row is checked).
    per_layer = [row for row in rows if row.get("layer_budgets")]  # rows of older runs have no per-layer record
    budgets = [max((b for b in column if b is not None), default=None) for column in zip(*(r["layer_budgets"] for r in per_layer))]
    layer_bounds = [None if not bounded or b is None else b + extra for b in budgets]
    layer_peaks = [max(column) for column in zip(*(r["layer_max_cache_entries"] for r in per_layer))]
    bound = (max((b for b in layer_bounds if b is not None), default=None) if per_layer else max(r["budget"] for r in rows) + extra) if bounded else None
    held = None if bound is None else (
        all(b is None or p <= b + room(r) for r in per_layer for b, p in zip(r["layer_budgets"], r["layer_max_cache_entries"]))
        if per_layer else peak <= bound
    )
    # The same bound over all heads of a layer (rows of older runs have no totals): kv_heads x (N_l + B).
    totals = [row for row in per_layer if row.get("layer_max_total_entries")]
    row_bounds = [[None if not bounded or b is None else h * (b + room(r))
                   for b, h in zip(r["layer_budgets"], r["layer_kv_heads"])] for r in totals]
    total_bounds = [max((b for b in column if b is not None), default=None) for column in zip(*row_bounds)]
    total_peaks = [max(column) for column in zip(*(r["layer_max_total_entries"] for r in totals))]
    if held and totals:
        held = all(b is None or p <= b for r, bounds in zip(totals, row_bounds)
                   for b, p in zip(bounds, r["layer_max_total_entries"]))
    return {
        "samples": n,
        "mean_prompt_tokens": sum(r["prompt_tokens"] for r in rows) / n,
        "max_prompt_tokens": max(r["prompt_tokens"] for r in rows),
        "mean_compression_ratio": sum(r["compression_ratio"] for r in rows) / n,  # paper Table 9
        "mean_ttft_s": sum(r["ttft_s"] for r in rows) / n,
        "mean_decode_s": sum(r["decode_s"] for r in rows) / n,
        "mean_new_tokens": sum(r["new_tokens"] for r in rows) / n,
        "max_cache_entries": peak,
        "cache_bound": bound,  # max over layers of N_l + B (query_aware=false: B or held question + 1); None when unbounded
        "cache_bound_held": held,  # every layer's peak <= its own N_l + B
        "layer_budgets": budgets,
        "layer_cache_bounds": layer_bounds,
        "layer_max_cache_entries": layer_peaks,
        "layer_total_bounds": total_bounds,  # per layer, all KV heads: kv_heads x (N_l + B) (None: unbounded)
        "layer_max_total_entries": total_peaks,
        "max_kv_cache_peak_bytes": max(r["kv_cache_peak_bytes"] for r in rows),
        "max_kv_cache_bytes": max(r.get("kv_cache_bytes", 0) for r in rows),
        "max_peak_memory_bytes": max(r["peak_memory_bytes"] for r in rows),
        **({"max_scratch_entries": max(r.get("max_scratch_entries", 0) for r in rows)}
           if any("max_scratch_entries" in r for r in rows) else {}),
    }


def run(cfg: DictConfig, run_dir: str | Path, *, checked: bool = False, holding_lock: bool = False) -> dict[str, Any]:
    """Execute (or resume) one run into `run_dir` and return its summary.

    checked: the caller has run check_run_config on `cfg` (run.py: Hydra's callback or the sweeper did);
    holding_lock: the caller holds `run_dir`'s RunLock (run.py takes it before importing torch).
    Raises Preempted (after writing the summary) when a stop signal arrived; run.py hands it on.
    """
    if not checked:
        check_run_config(cfg)
    plan = plan_run(cfg)
    samples = list(plan.task.samples())  # data problems surface before a run directory is created
    selection = shards.select(shards.parse_shard(cfg.get("shard")), samples, plan.task.shard_group)
    with contextlib.nullcontext() if holding_lock else RunLock(run_dir, cfg.get("lock_wait", 0)):
        return execute(cfg, plan, selection.samples, run_dir, selection)


def execute(cfg: DictConfig, plan: RunPlan, samples: list, run_dir: str | Path,
            selection: shards.Selection | None = None) -> dict[str, Any]:
    """The run itself, with `run_dir` locked by the caller: resume, model, every sample, summary.
    `selection`: a shard's samples (keydiff.run.shards), whose manifest goes beside its rows."""
    with StopSignals() as signals:
        store = ResultStore(run_dir, result_config(cfg), overwrite=bool(cfg.overwrite))
        if selection is not None:
            selection.write_manifest(store.dir)
        skip = store.done_ids - (store.failed_ids if cfg.get("retry_failed", False) else set())
        todo = [s for s in samples if s.id not in skip]
        log.info("run directory %s: %d samples, %d already done", store.dir, len(samples), len(samples) - len(todo))
        threads = set_threads(cfg.get("threads"))
        tracker = tracking.start(cfg, store.dir, store.rows)
        record = provenance_record()  # code, packages, environment: taken once, when the run starts
        code = code_label(record["code"])  # on every row: a resumed run may span commits
        invocation = invocations.start(record, int(cfg.get("batch_size", 1)), threads)  # its id goes on every row
        provenance = None
        loop_start = None
        try:
            if todo:
                with signals.interruptible():
                    load_start = time.perf_counter()
                    model, tokenizer = load_model_once(plan.model_cfg)
                    log.info("model loaded in %.1f s", time.perf_counter() - load_start)
                    stop_ids = eos_token_ids(model, tokenizer)
                    provenance = model_provenance(plan.model_cfg, model)
                    warm_up(plan, model, tokenizer, todo[0])
                loop_start = time.perf_counter()
                for row in tqdm(sample_rows(plan, model, tokenizer, stop_ids, todo, cfg, code, signals),
                                total=len(todo), desc=f"{plan.task.name}/{plan.policy_name}", unit="sample"):
                    row = {**row, "threads": threads, invocations.ROW_KEY: invocation["id"]}
                    store.append(row)
                    tracker.log_row(row)
                    signals.check()  # a signal during the write stops here, after the row is whole
        except Preempted as stop:
            log.warning("%s: stopping after %d rows; the next start resumes", stop, len(store.rows))
            invocation.update(stopped_by=str(stop), samples_wall_s=seconds_since(loop_start))
            record_invocation(cfg, plan, samples, store, record, provenance, invocation)
            raise
        invocation["samples_wall_s"] = seconds_since(loop_start)
        summary = record_invocation(cfg, plan, samples, store, record, provenance, invocation)
        tracker.finish(summary)
    return summary


def seconds_since(start: float | None) -> float | None:
    """Wall time of the sample loop started at `start` (time.perf_counter), None when it never started."""
    return None if start is None else time.perf_counter() - start


def sample_rows(plan: RunPlan, model, tokenizer, stop_ids, todo: list, cfg: DictConfig, code, signals):
    """The rows of the samples to run: one at a time, or `batch_size` decoding together (keydiff.run.batched), or
    a task's questions over one compressed context (its `mode`: keydiff.run.shared)."""
    if plan.task.mode != "independent":  # several questions over one compressed context
        from keydiff.run.shared import shared_rows  # it builds on this module's sample helpers

        yield from shared_rows(plan, model, tokenizer, stop_ids, todo, cfg, code, signals)
        return
    batch_size = int(cfg.get("batch_size", 1))
    if batch_size > 1:
        from keydiff.run.batched import batched_rows  # it builds on this module's sample helpers

        yield from batched_rows(plan, model, tokenizer, stop_ids, todo, cfg, code, signals, batch_size)
        return
    for sample in todo:
        yield process_sample(plan, model, tokenizer, stop_ids, sample, cfg, code, signals)


def record_invocation(cfg, plan: RunPlan, samples, store: ResultStore, record: dict[str, Any], provenance,
                      invocation: dict[str, Any]) -> dict[str, Any]:
    """summary.json once this invocation ends (or stops): rewritten with its entry appended to the run's
    invocations when it wrote rows (keydiff.run.invocations). One that wrote none changes nothing but
    `last_checked_at`, so a re-run that finds every sample done never replaces how the rows were computed
    (batch size, wall time, command) with its own settings; it writes the summary only where it is missing or
    older than the rows (a process killed before writing its own)."""
    previous = store.read_summary()
    wrote = any(row.get(invocations.ROW_KEY) == invocation["id"] for row in store.rows)
    if not wrote and previous is not None and invocations.covers(previous, store.rows):
        summary = {**previous, "last_checked_at": timestamp()}
        store.write_summary(summary)
        return summary
    invocation = {**invocation, "finished_at": timestamp()}
    return write_summary(cfg, plan, samples, store, record, provenance,
                         invocations.history(previous, store.rows, invocation))


def write_summary(cfg, plan: RunPlan, samples, store: ResultStore, record: dict[str, Any], provenance,
                  entries: list[dict[str, Any]], data: dict[str, str] | None = None) -> dict[str, Any]:
    """Metrics over the successful samples, plus how many failed and why, the invocations that computed the
    rows (`entries`: keydiff.run.invocations.history), and everything needed to reproduce (`record`:
    keydiff.run.provenance.provenance_record of the invocation writing it; `data`: the task's data_sources,
    recorded by the runs a merge of shards reads, keydiff.run.shard_merge)."""
    wanted = {s.id for s in samples}
    # In the task's sample order, whatever order the rows were written in (batched runs write them as samples finish).
    by_id = store.latest_rows()
    latest = [by_id[s.id] for s in samples if s.id in by_id]
    rows = [row for row in latest if succeeded(row)]
    failures = Counter(row.get("failure_reason", "unknown") for row in latest if is_failed(row))
    run = invocations.run_fields(entries)
    summary = {
        "run_dir": str(store.dir),
        "complete": wanted <= store.done_ids,
        "stopped_by": run["stopped_by"],  # the signal that ended the last invocation early, else None
        "limit": cfg.task.get("limit"),  # task.limit of this run; None = every sample
        "num_samples": len(rows),  # samples the metrics cover
        "num_failed": sum(failures.values()),
        "failures": dict(failures),  # failure_reason -> count
        "metrics": plan.task.summarize(rows) if rows else {},
        "statistics": run_statistics(rows, plan),
        "policy": plan.new_policy().describe(),
        "budget": plan.budget,
        "budget_ratio": plan.ratio,  # a ratio budget: each prediction row records its own N
        "block_size": plan.block_size,
        "attention_statistics": plan.statistics,
        "decode_eviction": plan.decode_eviction,
        "query_aware": plan.query_aware,
        # The run's, from its invocations: null where they differ (each invocation lists its own).
        "threads": run["threads"],
        "batch_size": run["batch_size"],  # sequences decoding together (1: one sample at a time)
        "samples_wall_s": run["samples_wall_s"],  # the invocations' sample loops, summed (null: one not recorded)
        "started_at": run["started_at"],  # when the first invocation started (before its model load)
        "invocations": entries,  # each invocation that wrote rows; a row's "invocation" names its id
        "max_prompt_tokens": cfg.get("max_prompt_tokens"),
        "config": OmegaConf.to_container(cfg, resolve=True),
        "code": {**record["code"], "row_commits": sorted({str(row.get("code")) for row in rows})},
        "packages": record["packages"],
        "environment": record["environment"],
        "model": provenance or model_provenance(plan.model_cfg),
        "data": plan.task.data_sources() if data is None else data,
        "written_at": timestamp(),
    }
    store.write_summary(summary)
    return summary
