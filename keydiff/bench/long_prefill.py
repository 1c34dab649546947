"""Long prompts under a fixed bound: prefill peak memory and time per prompt token from L = 4K to 128K.

    python -m keydiff.bench long_prefill                                  # 4K..128K, keydiff and full, N=1024, B=128
    python -m keydiff.bench long_prefill --lengths 4096,8192 --full-max-length 8192 --json results/bench/long.json

Each (policy, L) runs in a fresh interpreter on random weights of SmolLM2-135M's shape. Targets for the bounded
policy: at the largest L, peak memory <= 1.10 x and time per token <= 1.25 x the smallest L's. `full` runs up to
--full-max-length only.

Design: docs/design/benchmarks.md#prefill-decode-throughput
"""

from __future__ import annotations

import sys

from keydiff import build_policy, prefill
from keydiff.bench import common, runner

DEFAULT_LENGTHS = "4096,8192,16384,32768,65536,131072"
TARGETS = {"memory": 1.10, "time_per_token": 1.25}


def child(args) -> dict:
    """One (args.policy, args.length) in this fresh process."""
    device = args.device
    model, prompt = common.model_and_prompt(args, "random-smollm2", positions=args.length)
    budget = None if args.policy == "full" else args.budget
    prefill(model, prompt[:, : 2 * args.block_size], build_policy(args.policy), budget, args.block_size)  # warm-up
    common.release_memory(device)
    reset = common.reset_peak(device)
    state = prefill(model, prompt, build_policy(args.policy), budget, args.block_size)
    return {"policy": args.policy, "length": args.length, "seconds": state.seconds,
            "seconds_per_token": state.seconds / args.length, "peak_memory_bytes": common.peak_memory(device)[0],
            "peak_is_run_only": reset, "max_cache_entries": state.max_cache_entries,
            "kv_cache_bytes": state.cache.kv_cache_bytes}


def run_all(args) -> list[dict]:
    rows = []
    for name in args.names:
        for length in args.length_list:
            if name == "full" and length > args.full_max_length:
                rows.append({"policy": name, "length": length, "skipped": f"L > --full-max-length {args.full_max_length}"})
                continue
            print(f"  {name} L={length} (fresh process) ...", file=sys.stderr, flush=True)
            row = runner.measure_in_child("long_prefill", args, keep_failure=True, policy=name, length=length)
            rows.append({"policy": name, "length": length, "skipped": f"failed: {row['failed']}"} if "failed" in row
                        else row)
    return rows


def compare(rows: list[dict], budget: int, block: int) -> list[dict]:
    """Each measured row's memory and time per token over the same policy's at the smallest measured L."""
    for row in rows:
        first = next(r for r in rows if r["policy"] == row["policy"] and "skipped" not in r) if "skipped" not in row else None
        if first is not None:
            row["memory_ratio"] = row["peak_memory_bytes"] / first["peak_memory_bytes"]
            row["time_ratio"] = row["seconds_per_token"] / first["seconds_per_token"]
    columns = [("policy", 8), ("L", 0), ("peak MiB", 0), ("x at first L", 0), ("ms / token", 0), ("x at first L ", 0),
               ("peak entries", 0), ("KV MiB", 0)]
    table = []
    for r in rows:
        if "skipped" in r:
            table.append([r["policy"], str(r["length"]), "-", "-", "-", "-", "-", r["skipped"][:60]])
            continue
        table.append([r["policy"], str(r["length"]), f"{r['peak_memory_bytes'] / 2**20:.0f}", f"{r['memory_ratio']:.3f}",
                      f"{1000 * r['seconds_per_token']:.3f}", f"{r['time_ratio']:.3f}", str(r["max_cache_entries"]),
                      f"{r['kv_cache_bytes'] / 2**20:.1f}"])
    common.print_table(columns, table)
    verdicts = []
    for name in dict.fromkeys(r["policy"] for r in rows if r["policy"] != "full"):
        measured = [r for r in rows if r["policy"] == name and "skipped" not in r]
        if len(measured) < 2:
            continue
        last = measured[-1]
        verdict = {"policy": name, "from": measured[0]["length"], "to": last["length"],
                   "memory_ratio": last["memory_ratio"], "time_ratio": last["time_ratio"],
                   "memory_ok": last["memory_ratio"] <= TARGETS["memory"],
                   "time_ok": last["time_ratio"] <= TARGETS["time_per_token"]}
        verdicts.append(verdict)
        print(f"{name} (N={budget}, B={block}) L={verdict['from']} -> {verdict['to']}: peak memory "
              f"{verdict['memory_ratio']:.3f} x (target <= {TARGETS['memory']}: {'met' if verdict['memory_ok'] else 'NOT met'}), "
              f"time per token {verdict['time_ratio']:.3f} x (target <= {TARGETS['time_per_token']}: "
              f"{'met' if verdict['time_ok'] else 'NOT met'})")
    print("peak: VmHWM (CPU) or CUDA max allocated of the prefill alone, the model's weights resident; "
          "positions beyond SmolLM2's trained 8K context measure time and memory only")
    return verdicts


def check(args) -> None:
    try:
        args.length_list = [int(x) for x in args.lengths.split(",")]
    except ValueError:
        raise ValueError(f"--lengths must be a comma list of integers, got {args.lengths!r}") from None
    if any(length < 2 * args.block_size for length in args.length_list):
        raise ValueError(f"every length must be at least two blocks ({2 * args.block_size} tokens)")


def run(args) -> dict:
    setting = common.setting_line(args.device, args.torch_dtype, model="random-smollm2", attn=args.attn,
                                  L=args.lengths, N=args.budget, B=args.block_size, full_max_length=args.full_max_length)
    print(setting, flush=True)
    rows = run_all(args)
    verdicts = compare(rows, args.budget, args.block_size)
    return {"setting": setting, "targets": TARGETS, "results": rows, "verdicts": verdicts,
            "data": {"prompt": "random token ids", "seed": 0}}


CASE = runner.Case("long_prefill", run, __doc__, ("dtype", "attn", "threads", "device", "json", "policies", "budget",
                                                   "block_size"), check=check, child=child, options=(
    runner.option("--lengths", default=DEFAULT_LENGTHS, help=f"prompt lengths L (default {DEFAULT_LENGTHS})"),
    runner.option("--full-max-length", type=int, default=16384, help="longest L `full` runs at")),
    defaults={"policies": "keydiff,full"})


main = runner.entry(CASE, __spec__.name, __name__)  # `python -m keydiff.bench long_prefill`: this case
