"""Decode benchmark: the cost of evicting after every generated token, next to plain decoding.

    python -m keydiff.bench decode --model random-smollm2                  # per-token decode at N = 1024
    python -m keydiff.bench decode --model random-llama-3.2-3b --end-to-end   # TTFT + decode, L = 4096
    python -m keydiff.bench decode --memory-scaling                        # peak RSS at L = 4096 vs 16384

Default: evicting policies prefill L tokens at budget N and decode with B = 1; `full` prefills exactly N tokens,
so the ratio is the price of evicting, not of a longer context. Per policy: median ms per token, TTFT, and bytes
allocated per token from a separate profiled pass ("x KV": over the cache's key/value bytes). --end-to-end:
TTFT + decode, full keeping all of L. --memory-scaling: peak RSS per length, each in a fresh process.
Defaults by mode: L 2048 (end-to-end 4096), 32 new tokens (end-to-end 64, memory scaling 8), model smollm2-135m
(memory scaling: random-smollm2, policy keydiff).

Design: docs/design/benchmarks.md#prefill-decode-throughput
"""

from __future__ import annotations

import statistics
import sys

import torch

from keydiff import Decoder, build_policy, generate, prefill
from keydiff.bench import common, runner


def run_once(model, prompt, name: str, budget: int | None, block: int, new_tokens: int, decoder=None):
    """Prefill then decode exactly `new_tokens` tokens with eviction after every one (no stop token), through
    `decoder` if given (a keydiff.Decoder kept across calls, as a run keeps one)."""
    state = prefill(model, prompt, build_policy(name), budget, block, decoder=decoder)
    result = generate(model, state, new_tokens, eos_token_ids=(), evict=True, decoder=decoder)
    assert len(result.token_ids[0]) == new_tokens
    return state, result


def allocated_bytes(fn, device: str) -> dict[str, int]:
    """Bytes allocated while fn() runs: every positive "[memory]" record of the profiler, per device type (the raw
    records, as key_averages()' memory columns are net of frees per operator)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    before = torch.cuda.memory_stats().get("allocated_bytes.all.allocated", 0) if device == "cuda" else 0
    with profile(activities=activities, profile_memory=True, record_shapes=False) as prof:
        fn()
    totals = {"cpu": 0, "cuda": 0}
    for event in prof.profiler.kineto_results.events():
        if event.name() == "[memory]" and event.nbytes() > 0:
            kind = str(event.device_type()).rsplit(".", 1)[-1].lower()
            totals[kind] = totals.get(kind, 0) + event.nbytes()
    if device == "cuda":  # the caching allocator's own cumulative count, as a cross-check
        totals["cuda_allocator"] = torch.cuda.memory_stats().get("allocated_bytes.all.allocated", 0) - before
    return totals


def timed_run(model, prompt, name: str, budget: int | None, args, decoder=None) -> dict:
    """One prefill + decode: its TTFT, its decode time per step and the peak entries."""
    state, result = run_once(model, prompt, name, budget, args.block_size, args.new_tokens, decoder)
    return {"ttft_s": state.seconds, "per_token_s": result.seconds / (args.new_tokens - 1),
            "peak_entries": result.max_cache_entries}


def allocation_pass(model, prompt, name: str, budget: int | None, args, device: str) -> dict:
    """An untimed pass under the memory profiler: bytes allocated per decoded token, next to the KV bytes."""
    state = prefill(model, prompt, build_policy(name), budget, args.block_size)
    entries = max(p.shape[-1] for p in state.kept_positions)
    kv_bytes = common.kv_cache_bytes(state.cache, model, entries)
    steps = args.profile_tokens - 1
    allocated = allocated_bytes(lambda: generate(model, state, args.profile_tokens, eos_token_ids=()), device)
    per_step = {kind: total / steps for kind, total in allocated.items()}
    return {"cache_entries": entries, "kv_cache_bytes": kv_bytes, "alloc_bytes_per_token": per_step[device],
            "alloc_bytes_per_token_by_device": per_step, "alloc_to_kv": per_step[device] / kv_bytes}


def eviction_pass(model, prompt, name: str, budget: int | None, args) -> dict:
    """A separate profiled pass (profile=True: the GPU is synchronised around every statistic and eviction):
    ms per decoding step spent evicting and computing attention statistics, next to the step's own time."""
    state = prefill(model, prompt, build_policy(name), budget, args.block_size, profile=True)
    before = dict(state.cache.timings)
    result = generate(model, state, args.new_tokens, eos_token_ids=())
    steps = args.new_tokens - 1
    spent = {key: (state.cache.timings[key] - before[key]) * 1000 / steps for key in before}
    return {"profiled_ms_per_token": result.seconds * 1000 / steps, "eviction_ms_per_token": spent["eviction_s"],
            "statistics_ms_per_token": spent["statistics_s"]}


def measure_all(model, cases: dict[str, tuple[torch.Tensor, int | None]], args, device: str,
                eviction_times: bool = False) -> list[dict]:
    """cases: policy -> (prompt, budget). Warm-up, timed rounds (interleaved), then the allocation passes
    (and, with eviction_times, the profiled passes that split a step's time)."""
    # One Decoder per policy across its warm-up and rounds, as a run keeps one across its samples: the steps a
    # GPU captures as CUDA graphs are captured in the warm-up, so the timed rounds are the steady state.
    decoders = {name: Decoder(model, 1) for name in cases}
    runs = common.interleaved_rounds(
        {name: (lambda name=name, p=p, b=b: timed_run(model, p, name, b, args, decoders[name]))
         for name, (p, b) in cases.items()},
        args.repeats, device)
    rows = []
    for name, (prompt, budget) in cases.items():
        ttfts = [r["ttft_s"] for r in runs[name]]
        per_token = [r["per_token_s"] for r in runs[name]]
        row = {"policy": name, "prompt_tokens": prompt.shape[1], "ttft_median_s": statistics.median(ttfts),
               "decode_ms_per_token": 1000 * statistics.median(per_token),
               "decode_ms_per_token_all": [1000 * p for p in per_token],
               "total_median_s": statistics.median(t + p * (args.new_tokens - 1) for t, p in zip(ttfts, per_token)),
               "peak_entries": runs[name][-1]["peak_entries"]}
        print(f"  allocation pass: {name} ...", file=sys.stderr, flush=True)
        row.update(allocation_pass(model, prompt, name, budget, args, device))
        if eviction_times:
            print(f"  profiled pass: {name} ...", file=sys.stderr, flush=True)
            row.update(eviction_pass(model, prompt, name, budget, args))
        rows.append(row)
    return rows


def decode_mode(model, prompt, names, args, device) -> list[dict]:
    """Policies at N after an L-token prompt; full decodes from an N-token prompt (the same cache size)."""
    cases = {name: (prompt[:, : args.budget], None) if name == "full" else (prompt, args.budget) for name in names}
    rows = measure_all(model, cases, args, device, eviction_times=True)
    full = next((r for r in rows if r["policy"] == "full"), {})
    columns = [("policy", 10), ("prompt", 0), ("cache", 0), ("ms/token (median)", 0), ("x full@N", 0),
               ("per round", 0), ("evict ms (prof.)", 0), ("stats ms (prof.)", 0), ("TTFT s", 0),
               ("alloc MiB/token", 0), ("x KV", 0), ("KV MiB", 0)]
    table = []
    for r in rows:
        r["decode_ratio_to_full"] = common.ratio(r["decode_ms_per_token"], full.get("decode_ms_per_token"))
        rounds = zip(r["decode_ms_per_token_all"], full.get("decode_ms_per_token_all", []))
        per_round = [value / base for value, base in rounds]
        r["decode_ratio_to_full_per_round_median"] = statistics.median(per_round) if per_round else None
        table.append([r["policy"], str(r["prompt_tokens"]), str(r["cache_entries"]), f"{r['decode_ms_per_token']:.3f}",
                      common.fmt(r["decode_ratio_to_full"], ".2f"),
                      common.fmt(r["decode_ratio_to_full_per_round_median"], ".2f"),
                      f"{r['eviction_ms_per_token']:.3f}", f"{r['statistics_ms_per_token']:.3f}",
                      f"{r['ttft_median_s']:.4f}", f"{r['alloc_bytes_per_token'] / 2**20:.3f}", f"{r['alloc_to_kv']:.2f}",
                      f"{r['kv_cache_bytes'] / 2**20:.2f}"])
    common.print_table(columns, table)
    print(f"ms/token: decode time / {args.new_tokens - 1} steps; x full@N: over full decoding from an "
          "N-entry cache (ratio of medians; per round: median of the rounds' ratios); evict/stats ms: per step, "
          "from a separate profiled pass; alloc: bytes allocated on "
          f"{device} per step ({args.profile_tokens - 1}-step profiled pass); x KV: alloc over the KV cache's bytes")
    return rows


def end_to_end_mode(model, prompt, names, args, device) -> list[dict]:
    """The same L-token prompt for every policy: full keeps all of it, the others N."""
    rows = measure_all(model, {name: (prompt, None if name == "full" else args.budget) for name in names}, args, device)
    full = next((r for r in rows if r["policy"] == "full"), {})
    columns = [("policy", 10), ("cache", 0), ("TTFT s", 0), ("ms/token", 0), ("total s", 0), ("x full total", 0),
               ("x full TTFT", 0), ("x full ms/token", 0)]
    table = []
    for r in rows:
        for key in ("total_median_s", "ttft_median_s", "decode_ms_per_token"):
            r[f"{key}_ratio_to_full"] = common.ratio(r[key], full.get(key))
        table.append([r["policy"], str(r["cache_entries"]), f"{r['ttft_median_s']:.4f}", f"{r['decode_ms_per_token']:.3f}",
                      f"{r['total_median_s']:.4f}", common.fmt(r["total_median_s_ratio_to_full"], ".2f"),
                      common.fmt(r["ttft_median_s_ratio_to_full"], ".2f"),
                      common.fmt(r["decode_ms_per_token_ratio_to_full"], ".2f")])
    common.print_table(columns, table)
    print(f"total: TTFT + {args.new_tokens - 1} decode steps (medians over {args.repeats} runs); "
          "full holds the whole prompt, the others N entries")
    return rows


def rss_child(args) -> dict:
    """One policy at one length in this fresh process: peak RSS of loading, then of prefill + decode alone."""
    model, prompt = common.model_and_prompt(args)
    load_peak, name = common.peak_rss_bytes(), args.policies
    budget = None if name == "full" else args.budget
    peaks = common.rss_of(lambda: run_once(model, prompt, name, budget, args.block_size, args.new_tokens))
    cuda_peak = torch.cuda.max_memory_allocated() if args.device.startswith("cuda") else None
    return {"policy": name, "length": args.length, "load_peak_rss_bytes": load_peak, **peaks,
            "cuda_peak_allocated_bytes": cuda_peak}


def memory_scaling_mode(names, args) -> list[dict]:
    """Runs rss_child for every (policy, length) in its own interpreter and compares the peaks."""
    lengths = [int(x) for x in args.scaling_lengths.split(",")]
    rows = []
    for name in names:
        for length in lengths:
            print(f"  {name} L={length} (fresh process) ...", file=sys.stderr, flush=True)
            rows.append(runner.measure_in_child("decode", args, policies=name, length=length))
    columns = [("policy", 10), ("L", 0), ("N", 0), ("load peak MiB", 0), ("after load MiB", 0), ("peak RSS MiB", 0),
               ("growth", 0), ("above load MiB", 0), ("CUDA peak MiB", 0)]
    mib = lambda value: common.fmt(None if value is None else value / 2**20, ".0f")
    table = []
    for r in rows:
        first = next(x for x in rows if x["policy"] == r["policy"])
        r["growth"] = r["peak_rss_bytes"] / first["peak_rss_bytes"] - 1
        above = None if r["rss_after_load_bytes"] is None else r["peak_rss_bytes"] - r["rss_after_load_bytes"]
        table.append([r["policy"], str(r["length"]), "-" if r["policy"] == "full" else str(args.budget),
                      mib(r["load_peak_rss_bytes"]), mib(r["rss_after_load_bytes"]), mib(r["peak_rss_bytes"]),
                      f"{100 * r['growth']:+.1f}%", mib(above), mib(r["cuda_peak_allocated_bytes"])])
    common.print_table(columns, table)
    scope = ("of prefill + decode only (peak reset after loading)" if all(r["peak_is_run_only"] for r in rows)
             else "of the whole process (this OS cannot reset the peak: loading may set it)")
    print(f"peak RSS: VmHWM {scope}; growth: over the same policy's peak at L={lengths[0]}; "
          "above load: peak minus the RSS right after loading")
    return rows


def run(args) -> dict:
    names, device, dtype = args.names, args.device, args.torch_dtype
    fields = dict(model=args.model, attn=args.attn, L=args.length, N=args.budget, B=args.block_size,
                  new_tokens=args.new_tokens, repeats=args.repeats)
    if args.memory_scaling:
        fields.update(L=args.scaling_lengths, repeats=1)
    setting = common.setting_line(device, dtype, **fields)
    print(setting, flush=True)
    data = {"prompt": "random token ids per length (random_prompt, seed 0)"}
    if args.memory_scaling:
        rows = memory_scaling_mode(names, args)
    else:
        model, prompt = common.model_and_prompt(args)
        data = common.prompt_record(prompt)
        rows = (end_to_end_mode if args.end_to_end else decode_mode)(model, prompt, names, args, device)
    mode = "end-to-end" if args.end_to_end else "memory-scaling" if args.memory_scaling else "decode"
    return {"mode": mode, "setting": setting, "data": data, "results": rows}


def check(args) -> None:
    """Defaults that depend on the mode; the combinations that cannot run."""
    if args.end_to_end and args.memory_scaling:
        raise ValueError("--end-to-end and --memory-scaling are two modes: choose one")
    args.length = args.length or (4096 if args.end_to_end else 2048)
    args.new_tokens = args.new_tokens or (64 if args.end_to_end else 8 if args.memory_scaling else 32)
    args.model = args.model or ("random-smollm2" if args.memory_scaling else "smollm2-135m")
    if args.new_tokens < 2 or args.profile_tokens < 2:
        raise ValueError("--new-tokens and --profile-tokens must be >= 2")
    if args.memory_scaling and args.policies is None:
        args.policies = "keydiff"
    if not args.end_to_end and not args.memory_scaling and args.length < args.budget:
        raise ValueError("--length must be >= --budget: full decodes from the first N prompt tokens")


CASE = runner.Case("decode", run, __doc__, runner.RUN + ("policies", "new_tokens") + runner.SIZES, check=check,
                   child=rss_child, defaults={"length": None, "new_tokens": None}, options=(
    runner.option("--profile-tokens", type=int, default=5, help="tokens decoded in the allocation pass"),
    runner.option("--end-to-end", action="store_true", help="TTFT + decode on one prompt: full (all L) vs N"),
    runner.option("--memory-scaling", action="store_true", help="peak RSS per prompt length, fresh processes"),
    runner.option("--scaling-lengths", default="4096,16384", help="prompt lengths for --memory-scaling")))


main = runner.entry(CASE, __spec__.name, __name__)  # `python -m keydiff.bench decode`: this case
