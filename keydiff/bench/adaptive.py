"""Head-adaptive budgets (AdaKV) against the uniform policy: memory held and time per decoded token.

    python -m keydiff.bench adaptive                         # random SmolLM2-135M shape, L 4096, N 1024, B 128
    python -m keydiff.bench adaptive --scorer snapkv --threads 2 --json out/adaptive.json

Per policy: kv_cache_bytes, peak RSS (fresh process each), TTFT and decode ms per token; targets checked and
printed: bytes <= 1.05 x uniform, decode <= 1.25 x uniform. Timings on a shared machine are indicative.

Design: docs/design/benchmarks.md#prefill-decode-throughput
"""

from __future__ import annotations

import statistics
import sys

from keydiff import build_policy, generate, prefill
from keydiff.bench import common, runner

BYTES_TARGET, DECODE_TARGET = 1.05, 1.25


def policy_params(args, adaptive: bool) -> dict:
    return {"head_budgets": "adakv", "alpha_safeguard": args.alpha_safeguard} if adaptive else {}


def run_once(model, prompt, args, adaptive: bool) -> dict:
    """Prefill then decode exactly --new-tokens tokens, evicting after every one; what it cost."""
    policy = build_policy(args.scorer, **policy_params(args, adaptive))
    state = prefill(model, prompt, policy, args.budget, args.block_size)
    result = generate(model, state, args.new_tokens, eos_token_ids=(), evict=True)
    return {"ttft_s": state.seconds, "per_token_s": result.seconds / (args.new_tokens - 1),
            "kv_cache_bytes": state.cache.kv_cache_bytes, "allocations": state.cache.allocations,
            "max_total_entries": max(state.cache.layer_max_total_entries)}


def rss_child(args) -> dict:
    """One form (args.form) in this fresh process: peak RSS of prefill + decode alone."""
    model, prompt = common.model_and_prompt(args)
    return common.rss_of(lambda: run_once(model, prompt, args, args.form == "adakv"))


def check(args) -> None:
    for adaptive in (False, True):  # bad values fail here, before any model is built
        build_policy(args.scorer, **policy_params(args, adaptive)).check(args.budget)


def run(args) -> dict:
    device, dtype = args.device, args.torch_dtype
    setting = common.setting_line(device, dtype, model=args.model, scorer=args.scorer, L=args.length, N=args.budget,
                                  B=args.block_size, new_tokens=args.new_tokens, repeats=args.repeats,
                                  alpha_safeguard=args.alpha_safeguard)
    print(setting, flush=True)
    names = {"uniform": False, "adakv": True}
    memory = {}
    for name, adaptive in names.items():
        print(f"  peak RSS: {name} (fresh process) ...", file=sys.stderr, flush=True)
        memory[name] = runner.measure_in_child("adaptive", args, form=name)
    model, prompt = common.model_and_prompt(args)
    runs = common.interleaved_rounds(
        {name: (lambda adaptive=adaptive: run_once(model, prompt, args, adaptive)) for name, adaptive in names.items()},
        args.repeats, device)
    rows = []
    for name in names:
        per_token = [r["per_token_s"] for r in runs[name]]
        rss = memory[name]
        above = None if rss["rss_after_load_bytes"] is None else rss["peak_rss_bytes"] - rss["rss_after_load_bytes"]
        rows.append({"policy": f"{args.scorer}" + (" + adakv" if names[name] else ""), "form": name,
                     "kv_cache_bytes": runs[name][-1]["kv_cache_bytes"],
                     "max_total_entries": runs[name][-1]["max_total_entries"],
                     "allocations": runs[name][-1]["allocations"],
                     "peak_rss_bytes": rss["peak_rss_bytes"], "peak_rss_above_load_bytes": above,
                     "peak_is_run_only": rss["peak_is_run_only"],
                     "ttft_median_s": statistics.median(r["ttft_s"] for r in runs[name]),
                     "decode_ms_per_token": 1000 * statistics.median(per_token),
                     "decode_ms_per_token_all": [1000 * p for p in per_token]})
    uniform, adaptive = rows
    round_ratios = [a / u for a, u in zip(adaptive["decode_ms_per_token_all"], uniform["decode_ms_per_token_all"])]
    summary = {"bytes_ratio": adaptive["kv_cache_bytes"] / uniform["kv_cache_bytes"],
               "peak_rss_ratio": adaptive["peak_rss_bytes"] / uniform["peak_rss_bytes"],
               "decode_ratio": adaptive["decode_ms_per_token"] / uniform["decode_ms_per_token"],
               "decode_ratio_per_round_median": statistics.median(round_ratios),
               "ttft_ratio": adaptive["ttft_median_s"] / uniform["ttft_median_s"]}
    summary["bytes_target_met"] = summary["bytes_ratio"] <= BYTES_TARGET
    summary["decode_target_met"] = summary["decode_ratio"] <= DECODE_TARGET
    mib = lambda value: common.fmt(None if value is None else value / 2**20, ".1f")
    columns = [("policy", 10), ("KV MiB", 0), ("peak total entries/layer", 0), ("peak RSS MiB", 0),
               ("above load MiB", 0), ("TTFT s", 0), ("decode ms/token", 0)]
    common.print_table(columns, [[r["policy"], mib(r["kv_cache_bytes"]), str(r["max_total_entries"]),
                                  mib(r["peak_rss_bytes"]), mib(r["peak_rss_above_load_bytes"]),
                                  f"{r['ttft_median_s']:.2f}", f"{r['decode_ms_per_token']:.2f}"] for r in rows])
    print(f"adakv / uniform: KV bytes {summary['bytes_ratio']:.3f} (target <= {BYTES_TARGET}: "
          f"{'met' if summary['bytes_target_met'] else 'NOT met'}), peak RSS {summary['peak_rss_ratio']:.3f}, "
          f"TTFT {summary['ttft_ratio']:.2f}, decode {summary['decode_ratio']:.2f} (median of per-round ratios "
          f"{summary['decode_ratio_per_round_median']:.2f}; target <= {DECODE_TARGET}: "
          f"{'met' if summary['decode_target_met'] else 'NOT met'})")
    print(f"peak RSS: each policy in a fresh process, prefill + decode only; times: medians over {args.repeats} "
          "interleaved rounds (indicative on a shared machine)")
    return {"setting": setting, "data": common.prompt_record(prompt), "results": rows, "summary": summary}


CASE = runner.Case("adaptive", run, __doc__, runner.RUN + ("new_tokens",) + runner.SIZES, check=check,
                   child=rss_child, defaults={"model": "random-smollm2"}, options=(
    runner.option("--scorer", default="keydiff", help="the policy whose scores drive both forms"),
    runner.option("--alpha-safeguard", type=float, default=0.2)))


main = runner.entry(CASE, __spec__.name, __name__)  # `python -m keydiff.bench adaptive`: this case
