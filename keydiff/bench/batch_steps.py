"""Decode step time at batch 1 and k, rows grouped or each on its own: where batching's speed-up goes.

    python -m keydiff.bench batch_steps --threads 2 --batches 1,8 --policies keydiff
    python -m keydiff.bench batch_steps --threads 2 --batches 1,4,8,16 --json results/bench/batch_steps_cpu.json

Forks of one prefill decode through keydiff.generate_batch with group_rows on (rows holding the same count
attend and evict as one group) and off (each row alone, the reference). Per (policy, batch, grouping): the median
time of one decoding pass (steps alone), its ratio to batch 1 (target: <= 2.29 at batch 8, i.e. >= 3.5x the
tokens/s) and the aggregate tokens/s. Ratios from a loaded machine are a sanity signal, not results.

Design: docs/design/benchmarks.md#prefill-decode-throughput
"""

from __future__ import annotations

import statistics

from keydiff import build_policy, prefill
from keydiff.decode import Request, generate_batch
from keydiff.bench import common, runner


def step_seconds(model, state, batch: int, new_tokens: int, group_rows: bool) -> float:
    """Seconds per decoding pass of `batch` forks of `state` decoded together (no stop tokens)."""
    requests = [Request(fork, max_new_tokens=new_tokens, key=i) for i, fork in enumerate(state.fork(batch))]
    results = dict(generate_batch(model, requests, batch, group_rows=group_rows))
    return results[0].seconds / (new_tokens - 1)  # the first token comes from the prefill's logits


def run(args) -> dict:
    names, device, dtype = args.names, args.device, args.torch_dtype
    batches = [int(b) for b in args.batches.split(",")]
    print(common.setting_line(device, dtype, model=args.model, attn=args.attn, L=args.length, N=args.budget,
                              B=args.block_size, new_tokens=args.new_tokens, batches=args.batches,
                              repeats=args.repeats), flush=True)
    model, prompt = common.model_and_prompt(args)
    cases, keys = {}, {}
    for name in names:
        state = prefill(model, prompt, build_policy(name), None if name == "full" else args.budget, args.block_size)
        for batch in batches:
            for grouped in (True, False):
                label = f"{name} x{batch} {'grouped' if grouped else 'per-row'}"
                cases[label] = (lambda s=state, b=batch, g=grouped:
                                step_seconds(model, s, b, args.new_tokens, g))
                keys[label] = (name, batch, grouped)
    timings = common.interleaved_rounds(cases, args.repeats, device)
    rows = []
    for label, (name, batch, grouped) in keys.items():
        seconds = statistics.median(timings[label])
        rows.append({"policy": name, "batch": batch, "group_rows": grouped, "step_s": seconds,
                     "tokens_per_s": batch / seconds})
    base = {(r["policy"], r["group_rows"]): r["step_s"] for r in rows if r["batch"] == batches[0]}
    for row in rows:
        row["step_vs_batch_" + str(batches[0])] = common.ratio(row["step_s"], base[(row["policy"], row["group_rows"])])
    common.print_table([("policy", 12), ("batch", 5), ("rows", 8), ("ms/step", 8), ("x step", 7), ("tok/s", 8)],
                       [[r["policy"], str(r["batch"]), "grouped" if r["group_rows"] else "per-row",
                         common.fmt(r["step_s"] * 1e3, ".1f"), common.fmt(r["step_vs_batch_" + str(batches[0])], ".2f"),
                         common.fmt(r["tokens_per_s"], ".1f")] for r in rows], 3)
    return {"results": rows, "prompt": "random token ids (random_prompt, seed 0)", "prefill_included": False}


CASE = runner.Case("batch_steps", run, __doc__, runner.RUN + ("policies", "new_tokens") + runner.SIZES,
                   defaults={"model": "smollm2-135m", "policies": "keydiff", "new_tokens": 17}, options=(
    runner.option("--batches", default="1,8", help="batch sizes (the first is the ratios' base)"),))


main = runner.entry(CASE, __spec__.name, __name__)  # `python -m keydiff.bench batch_steps`: this case
