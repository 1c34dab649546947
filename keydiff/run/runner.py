"""One run: check everything, load the model, prefill + decode every sample, write the results.

Every configuration error is raised before the model loads. Design: docs/design/runs.md#one-run
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from keydiff.engine import generate, prefill
from keydiff.models import ModelConfig, eos_token_ids, load_model, model_provenance
from keydiff.run import invocations, shards, tracking
from keydiff.run.batched import batched_rows
from keydiff.run.checks import check_run_config
from keydiff.run.eviction import nothing_evicted
from keydiff.run.lock import RunLock
from keydiff.run.plan import RunPlan, plan_run, result_config
from keydiff.run.preemption import Preempted, StopSignals
from keydiff.run.progress import Progress
from keydiff.run.provenance import code_label, provenance_record, timestamp
from keydiff.run.results import ResultStore, current_names, is_failed, succeeded
from keydiff.run.samples import RunContext, process_sample
from keydiff.run.shared import shared_rows

log = logging.getLogger(__name__)
def set_threads(threads: int | None) -> int:
    """torch's intra-op threads from the `threads` key (default: SLURM_CPUS_PER_TASK); returns the count used."""
    if threads:
        torch.set_num_threads(int(threads))
    return torch.get_num_threads()


_LOADED: dict[str, Any] = {}  # the last loaded model, reused by the next run of a sweep in this process




def load_model_once(model_cfg: ModelConfig):
    """Load the model, reusing the previous run's if its configuration is identical (sequential sweeps)."""
    key = repr(model_cfg)
    if _LOADED.get("key") != key:
        _LOADED.clear()  # drop the old model before loading the next one
        _LOADED.update(key=key, value=load_model(model_cfg))
    return _LOADED["value"]


def warm_up(ctx: RunContext, sample) -> None:
    """One untimed prefill + decode on the start of the first prompt, so no sample's TTFT carries the device's
    start-up, nor (where the decoder replays CUDA graphs) the capture of its block and decode steps."""
    plan, model, tokenizer = ctx.plan, ctx.model, ctx.tokenizer
    prompt = plan.build_prompt(sample, tokenizer)
    ids = prompt.input_ids
    block = plan.block_size or 128
    policy = plan.new_policy()
    budget = plan.sample_budget(plan.compressed_tokens(prompt))  # the first sample's N: what that sample will run
    if budget is not None and plan.ratio is not None:
        try:
            policy.check(budget)
        except ValueError:
            return  # that sample is recorded as failed; nothing to warm up
    captures = ctx.decoder.replays_graphs and budget is not None and plan.block_size is not None
    if captures and 0 < len(ids) < budget + 3 * block:  # a short first prompt, repeated: its steps capture all the same
        ids = list(ids) * -(-(budget + 3 * block) // len(ids))
    tokens = min(len(ids), budget + 3 * block if captures else 2 * block)
    decoder = ctx.decoder if captures else None
    state = prefill(model, torch.tensor([ids[:tokens]]), policy, budget, plan.block_size,
                    attention_statistics=plan.statistics, tokenizer=tokenizer, decoder=decoder)
    generate(model, state, 3 if captures else 2, evict=plan.decode_eviction, batch_invariant=plan.batch_invariant,
             decoder=decoder)


def run_statistics(rows: list[dict[str, Any]], plan: RunPlan) -> dict[str, Any]:
    if not rows:
        return {"samples": 0}
    rows = [current_names(row) for row in rows]  # rows of older runs under the current field names
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
        "mean_kept_ratio": sum(r["kept_ratio"] for r in rows) / n,  # paper Table 9's "compression ratio"
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
        "max_kv_cache_held_peak_bytes": max(r["kv_cache_held_peak_bytes"] for r in rows),
        "max_kv_cache_allocated_bytes": max(r.get("kv_cache_allocated_bytes", 0) for r in rows),
        "max_peak_memory_bytes": max(r["peak_memory_bytes"] for r in rows),
        **({"max_scratch_entries": max(r.get("max_scratch_entries", 0) for r in rows)}
           if any("max_scratch_entries" in r for r in rows) else {}),
    }


def run(cfg: DictConfig, run_dir: str | Path, *, checked: bool = False, holding_lock: bool = False,
        invocation_fields: dict[str, Any] | None = None) -> dict[str, Any]:
    """Execute (or resume) one run into `run_dir` and return its summary; raises Preempted after writing the
    summary when a stop signal arrived. `checked`/`holding_lock`: the caller ran check_run_config / holds the lock."""
    if not checked:
        check_run_config(cfg)
    plan = plan_run(cfg)
    samples = list(plan.task.samples())  # data problems surface before a run directory is created
    selection = shards.select(shards.parse_shard(cfg.get("shard")), samples, plan.task.shard_group)
    with contextlib.nullcontext() if holding_lock else RunLock(run_dir, cfg.get("lock_wait", 0)):
        return execute(cfg, plan, selection.samples, run_dir, selection, invocation_fields)


def execute(cfg: DictConfig, plan: RunPlan, samples: list, run_dir: str | Path,
            selection: shards.Selection | None = None, invocation_fields: dict[str, Any] | None = None) -> dict[str, Any]:
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
        invocation.update(invocation_fields or {})
        if not todo and (note := invocations.no_effect(store.read_summary(), {
                "batch_size": int(cfg.get("batch_size", 1)), "threads": threads if cfg.get("threads") else None,
                "max_prompt_tokens": cfg.get("max_prompt_tokens")})):
            log.warning(note)  # e.g. batch_size=4 on a finished run: nothing computed at batch 4
        provenance = None
        loop_start = None
        ctx = None
        try:
            if todo:
                with signals.interruptible():
                    load_start = time.perf_counter()
                    model, tokenizer = load_model_once(plan.model_cfg)
                    log.info("model loaded in %.1f s", time.perf_counter() - load_start)
                    stop_ids = eos_token_ids(model, tokenizer)
                    provenance = model_provenance(plan.model_cfg, model)
                    ctx = RunContext(plan, model, tokenizer, stop_ids, code, signals, int(cfg.seed),
                                     int(cfg.get("batch_size", 1)), cfg.get("max_prompt_tokens"))
                    warm_up(ctx, todo[0])
                loop_start = time.perf_counter()
                with Progress(len(todo), f"{plan.task.name}/{plan.policy_name}",
                              tracking.headline(plan.task.name)[0]) as progress:
                    made = ctx.decoder.stats.capture_s if ctx is not None else 0.0  # graphs made so far
                    for row in sample_rows(ctx, todo):
                        paid, made = ctx.decoder.stats.capture_s - made, ctx.decoder.stats.capture_s
                        row = {**row, "threads": threads, invocations.ROW_KEY: invocation["id"],
                               **({"capture_s": round(paid, 6)} if paid else {})}  # graphs its times include
                        store.append(row)
                        tracker.log_row(row)
                        progress.done(row)
                        signals.check()  # a signal during the write stops here, after the row is whole
        except Preempted as stop:
            stop.progress = f"{len(store.done_ids & {s.id for s in samples})} of {len(samples)} samples done"
            invocation.update(stopped_by=str(stop), samples_wall_s=seconds_since(loop_start),
                              **decoding_record(ctx))
            record_invocation(cfg, plan, samples, store, record, provenance, invocation)
            raise
        invocation.update(samples_wall_s=seconds_since(loop_start), **decoding_record(ctx))
        summary = record_invocation(cfg, plan, samples, store, record, provenance, invocation)
        tracker.finish(summary)
    return summary


def decoding_record(ctx: RunContext | None) -> dict[str, Any]:
    """How the invocation's decoding ran, for its summary entry: the widths its decoder ran at, the CUDA graphs
    captured or failed (with why) and the steps it built and ran; None where no sample ran."""
    if ctx is None:
        return {"decode_widths": None, "decode_graphs": None, "decode_steps": None}
    stats = ctx.decoder.stats
    return {"decode_widths": list(ctx.decoder.widths), "decode_graphs": stats.record(),
            "decode_steps": stats.steps_record()}


def seconds_since(start: float | None) -> float | None:
    """Wall time of the sample loop started at `start` (time.perf_counter), None when it never started."""
    return None if start is None else time.perf_counter() - start


def sample_rows(ctx: RunContext, todo: list):
    """The rows of the samples to run: one at a time, or `batch_size` decoding together (keydiff.run.batched), or
    a task's questions over one compressed context (its `mode`: keydiff.run.shared)."""
    if ctx.plan.task.mode != "independent":  # several questions over one compressed context
        yield from shared_rows(ctx, todo)
    elif ctx.batch_size > 1:
        yield from batched_rows(ctx, todo)
    else:
        for sample in todo:
            yield process_sample(ctx, sample)


def record_invocation(cfg, plan: RunPlan, samples, store: ResultStore, record: dict[str, Any], provenance,
                      invocation: dict[str, Any]) -> dict[str, Any]:
    """Rewrite summary.json once this invocation ends or stops, its entry appended when it wrote rows; one that
    wrote none changes only `last_checked_at` (or writes a missing or stale summary)."""
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
    """Write summary.json: metrics over the successful samples, the failures and why, the invocations behind the
    rows (`entries`), the provenance `record` and the task's `data` sources."""
    wanted = {s.id for s in samples}
    # In the task's sample order, whatever order the rows were written in (batched runs write them as samples finish).
    by_id = store.latest_rows()
    latest = [by_id[s.id] for s in samples if s.id in by_id]
    rows = [current_names(row) for row in latest if succeeded(row)]  # rows of older runs under current names
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
    summary["nothing_evicted"] = nothing_evicted(summary)  # the budget never bound: scores as the full cache
    store.write_summary(summary)
    return summary
