"""Throughput benchmark: decode tokens/s of many sequences at once (keydiff.batching), bounded vs full caches.

    python -m keydiff.bench.throughput                               # tokens/s at batch 1, 4, 8, 16
    python -m keydiff.bench.throughput --serving --memory-gb 4       # sequences held and tokens/s in 4 GB
    python -m keydiff.bench.throughput --device cuda --json results/bench/throughput_cuda.json

Default mode. One prompt of L tokens (default 4096) is prefilled once per policy (`full`: all L entries;
the others: N, default 1024) and forked into `batch` independent caches (PrefillResult.fork), which then
decode --new-tokens tokens together through keydiff.generate_batch, evicting after every token. Reported per
(policy, batch): aggregate decode tokens/s (batch x tokens / wall time of the decode; prefill not included)
and its ratio to the same policy at batch 1. The `transformers` row is the anchor: the same L-token prompt in
transformers' own DynamicCache, batch rows decoded by a plain greedy loop (what a transformers user gets from
a full cache at that batch); `--continuous-batching` adds transformers' `generate_batch` (paged full caches)
where it runs on the device.

--serving: for a memory budget for the caches (--memory-gb) and each prompt length in --lengths (default
4096,16384,32768), how many sequences each policy holds at once (full: L + new tokens entries per layer and KV
head; bounded: N + 1) and their aggregate steady-state decode tokens/s at that batch (capped by --max-batch;
the caches are in the state a prefill of L tokens leaves, by one prefill forked; prefill not included).

Timings are medians over --repeats after one untimed warm-up; take them on a quiet machine.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from keydiff import build_policy, prefill
from keydiff.batching import Request, generate_batch
from keydiff.bench import common


def forked_states(model, prompt: torch.Tensor, name: str, budget: int, block: int, copies: int):
    """`copies` decode-ready states of one prefill (full keeps every prompt token)."""
    state = prefill(model, prompt, build_policy(name), None if name == "full" else budget, block)
    return state.fork(copies)


def batched_decode_seconds(model, states, new_tokens: int, device: str) -> float:
    """Wall time of decoding `new_tokens` tokens for every state together (no stop tokens)."""
    requests = [Request(state, max_new_tokens=new_tokens, key=i) for i, state in enumerate(states)]
    common.sync(device)
    start = time.perf_counter()
    for _ in generate_batch(model, requests, len(requests)):
        pass
    common.sync(device)
    return time.perf_counter() - start


def keydiff_case(model, prompt, name: str, batch: int, args, device: str):
    def run() -> float:
        states = forked_states(model, prompt, name, args.budget, args.block_size, batch)  # untimed
        return batched_decode_seconds(model, states, args.new_tokens, device)

    return run


@torch.inference_mode()
def transformers_case(model, prompt, batch: int, args, device: str):
    """transformers' DynamicCache with the whole prompt, `batch` rows, a plain greedy decode loop."""
    from transformers import DynamicCache

    def run() -> float:
        cache = DynamicCache(config=model.config)
        # One row prefilled, then its cache repeated to `batch` rows (a batch-16 prefill of 4K tokens in one
        # forward needs tens of GB of activations on CPU; the decode, what is timed, is the same either way).
        logits = model(input_ids=prompt.to(device), cache=cache, use_cache=True, logits_to_keep=1).logits
        cache.batch_repeat_interleave(batch)
        token = logits[:, -1].argmax(-1, keepdim=True).expand(batch, -1).contiguous()
        common.sync(device)
        start = time.perf_counter()
        for _ in range(args.new_tokens - 1):
            logits = model(input_ids=token, cache=cache, use_cache=True).logits
            token = logits[:, -1].argmax(-1, keepdim=True)
        common.sync(device)
        return time.perf_counter() - start

    return run


def continuous_batching_case(model, prompt, batch: int, args, device: str):
    """transformers' own continuous batching (`model.generate_batch`, paged full caches, no eviction): wall
    time of `batch` copies of the prompt, prefill and the manager's start-up included (it interleaves prefill
    and decode, so decode alone cannot be timed from outside)."""
    from transformers import GenerationConfig

    def run() -> float:
        config = GenerationConfig(max_new_tokens=args.new_tokens, do_sample=False, eos_token_id=-1)
        common.sync(device)
        start = time.perf_counter()
        model.generate_batch([prompt[0].tolist()] * batch, generation_config=config)
        common.sync(device)
        return time.perf_counter() - start

    return run


def decode_mode(model, prompt, names: list[str], args, device: str) -> list[dict]:
    batches = [int(b) for b in args.batches.split(",")]
    tokens = args.new_tokens - 1  # decoding passes: the first token comes from the prefill's logits
    cases = {}
    for name in names:
        for batch in batches:
            cases[(name, batch)] = keydiff_case(model, prompt, name, batch, args, device)
    if args.transformers:
        for batch in batches:
            cases[("transformers", batch)] = transformers_case(model, prompt, batch, args, device)
    if args.continuous_batching:
        for batch in batches:
            cases[("transformers-cb", batch)] = continuous_batching_case(model, prompt, batch, args, device)
    timings = common.interleaved_rounds({f"{n} x{b}": fn for (n, b), fn in cases.items()}, args.repeats, device)
    rows = []
    for (name, batch) in cases:
        seconds = statistics.median(timings[f"{name} x{batch}"])
        rows.append({"policy": name, "batch": batch, "seconds": seconds,
                     "tokens_per_s": batch * (args.new_tokens if name == "transformers-cb" else tokens) / seconds,
                     "entries": args.length if name in ("full", "transformers", "transformers-cb") else args.budget,
                     "includes_prefill": name == "transformers-cb"})
    base = {row["policy"]: row["tokens_per_s"] for row in rows if row["batch"] == batches[0]}
    for row in rows:
        row["speedup_vs_batch_" + str(batches[0])] = common.ratio(row["tokens_per_s"], base.get(row["policy"]))
    common.print_table([("policy", 16), ("batch", 5), ("tok/s", 8), ("x batch " + str(batches[0]), 10)],
                       [[r["policy"], str(r["batch"]), common.fmt(r["tokens_per_s"], ".1f"),
                         common.fmt(r["speedup_vs_batch_" + str(batches[0])], ".2f", "x")] for r in rows], 2)
    return rows


def serving_mode(model, names: list[str], args, device: str) -> list[dict]:
    budget_bytes = args.memory_gb * (1 << 30)
    per_entry = common.kv_cache_bytes(None, model, 1)  # keys + values of one token, every layer and KV head
    rows = []
    for length in [int(x) for x in args.lengths.split(",")]:
        prompt = common.random_prompt(model, length).to(device)
        for name in names:
            entries = length + args.new_tokens if name == "full" else args.budget + 1
            held = int(budget_bytes // (per_entry * entries))
            batch = min(held, args.max_batch)
            row = {"L": length, "policy": name, "entries_per_sequence": entries, "sequences_held": held,
                   "measured_batch": batch, "tokens_per_s": None}
            if batch >= 1:
                fn = keydiff_case(model, prompt, name, batch, args, device)
                times = common.interleaved_rounds({f"{name} L={length} x{batch}": fn}, args.repeats, device)
                row["tokens_per_s"] = batch * (args.new_tokens - 1) / statistics.median(next(iter(times.values())))
            rows.append(row)
        full = next((r for r in rows if r["L"] == length and r["policy"] == "full"), None)
        for row in rows:
            if row["L"] == length and full is not None:
                row["sequences_vs_full"] = common.ratio(row["sequences_held"], full["sequences_held"])
                row["tokens_per_s_vs_full"] = common.ratio(row["tokens_per_s"], full["tokens_per_s"])
    common.print_table([("L", 6), ("policy", 10), ("held", 6), ("batch", 6), ("tok/s", 8), ("x full", 7)],
                       [[str(r["L"]), r["policy"], str(r["sequences_held"]), str(r["measured_batch"]),
                         common.fmt(r["tokens_per_s"], ".1f"), common.fmt(r.get("tokens_per_s_vs_full"), ".2f", "x")]
                        for r in rows], 2)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_common_arguments(parser)
    parser.add_argument("--device", default=None, choices=["cpu", "cuda"], help="default: cuda when available")
    parser.add_argument("--policies", default="full,keydiff", help="comma list (default full,keydiff)")
    parser.add_argument("--length", type=int, default=4096, help="prompt tokens L")
    parser.add_argument("--budget", type=int, default=1024, help="entries kept per layer and KV head, N")
    parser.add_argument("--block-size", type=int, default=128, help="prompt tokens per prefill forward, B")
    parser.add_argument("--new-tokens", type=int, default=18, help="tokens decoded per sequence")
    parser.add_argument("--batches", default="1,4,8,16", help="batch sizes (the first is the ratios' base)")
    parser.add_argument("--no-transformers", dest="transformers", action="store_false",
                        help="skip the DynamicCache anchor")
    parser.add_argument("--continuous-batching", action="store_true",
                        help="also time transformers' generate_batch (paged full caches; prefill included)")
    parser.add_argument("--serving", action="store_true", help="sequences held and tokens/s within --memory-gb")
    parser.add_argument("--memory-gb", type=float, default=4.0, help="memory for the caches (--serving)")
    parser.add_argument("--lengths", default="4096,16384,32768", help="prompt lengths L (--serving)")
    parser.add_argument("--max-batch", type=int, default=64, help="largest batch actually decoded (--serving)")
    args = parser.parse_args(argv)
    started = common.provenance(__spec__.name, argv)
    if args.new_tokens < 2 or args.repeats < 1:
        parser.error("--new-tokens must be >= 2 and --repeats >= 1")
    names = common.parse_policies(parser, args.policies, args.budget)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available")
    device, dtype = common.apply_runtime(args)
    device = args.device or device
    args.model = args.model or "smollm2-135m"
    fields = dict(model=args.model, attn=args.attn, N=args.budget, B=args.block_size, new_tokens=args.new_tokens,
                  repeats=args.repeats)
    fields.update({"lengths": args.lengths, "memory_gb": args.memory_gb} if args.serving
                  else {"L": args.length, "batches": args.batches})
    setting = common.setting_line(device, dtype, **fields)
    print(setting, flush=True)
    model = common.build_model(args.model, dtype, args.attn, device)
    if args.serving:
        rows = serving_mode(model, names, args, device)
        data = {"prompt": "random token ids per length (random_prompt, seed 0)", "prefill_included": False}
    else:
        prompt = common.random_prompt(model, args.length).to(device)
        rows = decode_mode(model, prompt, names, args, device)
        data = {**common.prompt_record(prompt), "prefill_included": False}
    if args.json:
        common.write_json(args.json, {"mode": "serving" if args.serving else "decode", "setting": setting,
                                      "data": data, "results": rows}, started)


if __name__ == "__main__":
    main()
