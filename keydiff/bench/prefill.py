"""Prefill benchmark: time to first token (TTFT) per policy at one (prompt length L, budget N, block size B).

    python -m keydiff.bench prefill                                   # CPU: the offline default model
    python -m keydiff.bench prefill --model random-llama-3.2-3b --dtype bfloat16 --length 8192 --budget 2048
    python -m keydiff.bench prefill --attn eager --statistics materialized   # the paper's eager setting
    python -m keydiff.bench prefill --policies full --block-size 4096 --length 4096 --reference

TTFT is the median of unprofiled interleaved rounds after an untimed warm-up; the statistics and eviction shares
come from one separate profiled run. --reference times a plain transformers forward of the same prompt, which
`full` with B = L should match. `random-*` models have public architectures with random weights (no download).

Design: docs/design/benchmarks.md#prefill-decode-throughput
"""

from __future__ import annotations

import statistics
import sys

import torch

from keydiff import Decoder, build_policy, prefill
from keydiff.bench import common, runner
from keydiff.config import STATISTICS_MODES


def prefill_run(model, prompt, name: str, args, profile: bool, decoder=None):
    return prefill(model, prompt, build_policy(name), args.budget, args.block_size,
                   attention_statistics=args.statistics, profile=profile, decoder=decoder)


def timed_policy_run(model, prompt, name: str, args, decoder=None) -> dict:
    """One unprofiled prefill (through `decoder`, kept across runs, if given): its TTFT and what its cache held."""
    state = prefill_run(model, prompt, name, args, profile=False, decoder=decoder)
    kept = max(p.shape[-1] for p in state.kept_positions)
    return {"ttft_s": state.seconds, "peak_entries": state.max_cache_entries,
            "kv_cache_bytes": common.kv_cache_bytes(state.cache, model, kept)}


@torch.inference_mode()
def timed_reference_run(model, prompt, device: str) -> dict:
    """A plain transformers prefill: one forward of the whole prompt, logits of the last position only."""
    return {"ttft_s": common.timed(device, lambda: model(prompt, logits_to_keep=1))[0]}


def summarize(name: str, runs: list[dict]) -> dict:
    times = [r["ttft_s"] for r in runs]
    row = {"policy": name, "ttft_median_s": statistics.median(times), "ttft_min_s": min(times), "ttft_all_s": times}
    row.update({key: runs[-1][key] for key in ("peak_entries", "kv_cache_bytes") if key in runs[-1]})
    return row


def profiled_shares(model, prompt, name: str, args) -> dict:
    """A SEPARATE profiled run (GPU synchronised around each statistic and eviction): the shares of its time."""
    profiled = prefill_run(model, prompt, name, args, profile=True)
    timings = profiled.cache.timings
    return {"profiled_s": profiled.seconds, "statistics_share": timings["statistics_s"] / profiled.seconds,
            "eviction_share": timings["eviction_s"] / profiled.seconds}


def run(args) -> dict:
    names, device, dtype = args.names, args.device, args.torch_dtype
    model, prompt = common.model_and_prompt(args)
    setting = common.setting_line(device, dtype, model=args.model, attn=args.attn, statistics=args.statistics,
                                  L=args.length, N=args.budget, B=args.block_size, repeats=args.repeats)
    print(setting, flush=True)

    cases = {"reference": lambda: timed_reference_run(model, prompt, device)} if args.reference else {}
    # One Decoder per policy across its warm-up and rounds, as a run keeps one across its prompts: the block step a
    # GPU captures as a CUDA graph is captured in the warm-up, so the timed rounds are the steady state.
    decoders = {name: Decoder(model, 1) for name in names}
    for name in names:
        cases[name] = lambda name=name: timed_policy_run(model, prompt, name, args, decoders[name])
    runs = common.interleaved_rounds(cases, args.repeats, device)
    rows = [summarize(name, runs[name]) for name in cases]
    for row in rows:
        if row["policy"] != "reference":
            print(f"  profiled pass: {row['policy']} ...", file=sys.stderr, flush=True)
            row.update(profiled_shares(model, prompt, row["policy"], args))
    full = next((r["ttft_median_s"] for r in rows if r["policy"] == "full"), None)
    reference = rows[0]["ttft_median_s"] if args.reference else None
    for row in rows:
        row["ratio_to_full"] = common.ratio(row["ttft_median_s"], full)
        row["ratio_to_reference"] = common.ratio(row["ttft_median_s"], reference)

    columns = [("policy", 12), ("TTFT s (median)", 0), ("min", 0), ("x full", 0), ("x ref", 0),
               ("stats % (prof.)", 0), ("evict % (prof.)", 0), ("peak entries", 0), ("KV MiB", 0)]
    table = []
    for r in rows:
        share = lambda key: None if key not in r else 100 * r[key]
        kv = r.get("kv_cache_bytes")
        table.append([r["policy"], f"{r['ttft_median_s']:.4f}", f"{r['ttft_min_s']:.4f}",
                      common.fmt(r["ratio_to_full"], ".2f"), common.fmt(r["ratio_to_reference"], ".2f"),
                      common.fmt(share("statistics_share"), ".1f", "%"), common.fmt(share("eviction_share"), ".1f", "%"),
                      str(r.get("peak_entries", "-")), common.fmt(None if kv is None else kv / 2**20, ".1f")])
    common.print_table(columns, table)
    print("x full / x ref: median TTFT over full's / the plain forward's; stats/evict %: shares of a separate "
          "profiled run (profile=True), not of the TTFT.")
    return {"setting": setting, "data": common.prompt_record(prompt), "results": rows}


CASE = runner.Case("prefill", run, __doc__, runner.RUN + ("policies",) + runner.SIZES, options=(
    runner.option("--statistics", default="fast", choices=STATISTICS_MODES),
    runner.option("--reference", action="store_true", help="also time a plain transformers forward")),
    defaults={"model": "smollm2-135m"})


main = runner.entry(CASE, __spec__.name, __name__)  # `python -m keydiff.bench prefill`: this case
