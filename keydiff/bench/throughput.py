"""Throughput benchmark: decode tokens/s of many sequences at once (keydiff.decode), bounded vs full caches.

    python -m keydiff.bench throughput                               # tokens/s at batch 1, 4, 8, 16
    python -m keydiff.bench throughput --serving --memory-gb 4       # sequences held and tokens/s in 4 GB
    python -m keydiff.bench throughput --device cuda --json results/bench/throughput_cuda.json

Default: one prompt prefilled per policy and forked into `batch` caches decoded together (generate_batch), with
transformers' DynamicCache loop as the anchor; --per-row, --pooled and --continuous-batching add cases.
--serving: how many sequences each policy holds in --memory-gb and their tokens/s. Medians over --repeats after
one untimed warm-up; prefill not included.

Design: docs/design/benchmarks.md#prefill-decode-throughput
"""

from __future__ import annotations

import statistics
import sys

import torch

from keydiff import build_policy, prefill
from keydiff.decode import Request, generate_batch
from keydiff.bench import common, runner


def prefilled(model, prompt: torch.Tensor, name: str, budget: int, block: int):
    """The decode-ready state of one prefill (full keeps every prompt token); cases fork it, never decode it."""
    announce(f"prefill {name}: {prompt.shape[-1]} tokens, once (untimed)")
    return prefill(model, prompt, build_policy(name), None if name == "full" else budget, block)


def announce(step: str) -> None:
    """A step before the timed cases (loading, prefills), on stderr beside the cases' progress lines."""
    print(f"  {step} ...", file=sys.stderr, flush=True)


def batched_decode(model, states, new_tokens: int, device: str, group_rows: bool = True,
                   pool_rows: bool = True) -> dict:
    """Wall time of decoding `new_tokens` tokens for every state together (no stop tokens), and the bytes the
    decoded caches hold at the end (the sum of the rows' kv_cache_bytes: what the batch's caches took)."""
    requests = [Request(state, max_new_tokens=new_tokens, key=i) for i, state in enumerate(states)]
    seconds, results = common.timed(device, lambda: list(generate_batch(model, requests, len(requests),
                                                                        group_rows=group_rows, pool_rows=pool_rows)))
    return {"seconds": seconds, "kv_cache_bytes": sum(result.kv_cache_bytes for _, result in results)}


def keydiff_case(model, state, batch: int, args, device: str, group_rows: bool = True):
    def run() -> dict:  # the fork is untimed
        return batched_decode(model, state.fork(batch), args.new_tokens, device, group_rows)

    return run


def pooled_case(model, state, batch: int, args, device: str):
    """`batch` copies of the prefilled state, each in buffers of its own as a prompt prefilled alone is (untimed),
    decoded with pool_rows=True: each joins a slot of one block (one copy of its entries, timed) and the rows
    group like forks (keydiff.decode.blocks.JoinPool)."""
    def run() -> dict:
        return batched_decode(model, [state.fork(1)[0] for _ in range(batch)], args.new_tokens, device,
                              pool_rows=True)

    return run


def with_peak(run, device: str):
    """`run`, also returning the peak memory of the call ("peak_bytes": VmHWM after a reset on CPU, max allocated
    on CUDA), so a case that holds more than its caches shows up in the results (reset and read are untimed)."""
    def measured() -> dict:
        common.reset_peak(device)
        result = run()
        result["peak_bytes"] = common.peak_memory(device)[0]
        return result

    return measured


@torch.inference_mode()
def transformers_prefill(model, prompt, device: str) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
    """The anchor's one prefill: the prompt in one forward into transformers' DynamicCache; its layers' keys and
    values and the first generated token (every batch size of the anchor decodes from copies of it)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    logits = model(input_ids=prompt.to(device), cache=cache, use_cache=True, logits_to_keep=1).logits
    return [(layer.keys, layer.values) for layer in cache.layers], logits[:, -1].argmax(-1, keepdim=True)


def transformers_case(model, prefilled, batch: int, args, device: str):
    """transformers' DynamicCache with the whole prompt, `batch` rows, a plain greedy decode loop. `prefilled`:
    transformers_prefill's result, repeated to `batch` rows (untimed; a batch-16 prefill of 4K tokens in one
    forward needs tens of GB of activations on CPU, and the decode, what is timed, is the same either way)."""
    from transformers import DynamicCache

    @torch.inference_mode()  # on `run`, which is what executes: without it autograd kept every step's cache
    def run() -> dict:  # (each torch.cat's inputs, ~24 GB at L=4096 batch 8 with the weights requiring grad)
        layers, first = prefilled
        cache = DynamicCache(config=model.config)
        for index, (keys, values) in enumerate(layers):
            cache.update(keys.repeat_interleave(batch, 0), values.repeat_interleave(batch, 0), index)
        token = first.expand(batch, -1).contiguous()

        def steps(token):
            for _ in range(args.new_tokens - 1):
                token = model(input_ids=token, cache=cache, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)

        return {"seconds": common.timed(device, lambda: steps(token))[0], "kv_cache_bytes": sum(
            layer.keys.numel() * layer.keys.element_size() * 2 for layer in cache.layers)}

    return run


def paged_cache_config(length: int, new_tokens: int, batch: int):
    """transformers' ContinuousBatchingConfig with the paged cache sized for `batch` requests of `length` +
    `new_tokens` tokens. Why: left to itself it sizes the cache at 90% of the free device memory, which on CPU is
    the host's RAM (psutil): 14 GB allocated and zeroed for a 4-token run of the tiny test model."""
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    page = ContinuousBatchingConfig.page_size
    pages = -(-(length + new_tokens) // page)  # per request and layer group
    return ContinuousBatchingConfig(num_blocks=batch * pages + 1)  # tokens per step: transformers' default


def continuous_batching_case(model, prompt, batch: int, args, device: str):
    """transformers' own continuous batching (`model.generate_batch`, paged full caches, no eviction). Its decode runs
    behind a background thread, so "seconds" is the difference of a --new-tokens run and a 1-token run (the decode of
    new_tokens - 1 tokens); "seconds_with_prefill" the long run's wall time."""
    from transformers import GenerationConfig

    def timed(new_tokens: int) -> float:
        config = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1)
        seconds, out = common.timed(device, lambda: model.generate_batch(
            [prompt[0].tolist()] * batch, generation_config=config,
            continuous_batching_config=paged_cache_config(prompt.shape[-1], new_tokens, batch)))
        if len(out) != batch or any(len(o.generated_tokens) != new_tokens for o in out.values()):
            raise RuntimeError(f"transformers' generate_batch returned {len(out)} of {batch} sequences or fewer "
                               f"than {new_tokens} tokens (see its log)")
        return seconds

    def run() -> dict:
        whole = timed(args.new_tokens)
        return {"seconds": whole - timed(1), "seconds_with_prefill": whole}

    return run


def continuous_batching_unavailable(device: str) -> str | None:
    """Why transformers' generate_batch cannot be measured here, or None when it can (it runs on CPU and CUDA
    in transformers >= 5; older versions lack it)."""
    try:
        from transformers.generation.continuous_batching import ContinuousBatchingManager  # noqa: F401
    except ImportError as error:
        return f"transformers' continuous batching is not available in this transformers version: {error}"
    return None


def decode_mode(model, prompt, names: list[str], args, device: str) -> list[dict]:
    batches = [int(b) for b in args.batches.split(",")]
    tokens = args.new_tokens - 1  # decoding passes: the first token comes from the prefill's logits
    cases = {}
    for name in names:
        state = prefilled(model, prompt, name, args.budget, args.block_size)  # once per policy
        for batch in batches:
            cases[(name, batch)] = keydiff_case(model, state, batch, args, device)
            if args.per_row and name != "full":  # what separately prefilled prompts get: no grouping
                cases[(name + " per-row", batch)] = keydiff_case(model, state, batch, args, device, False)
            if args.pooled and name != "full":  # separately prefilled prompts moved into one block as they join
                cases[(name + " pooled", batch)] = pooled_case(model, state, batch, args, device)
    if args.transformers:
        announce(f"prefill transformers: {prompt.shape[-1]} tokens in one forward, once (untimed)")
        anchor = transformers_prefill(model, prompt, device)  # once, like the policies' prefills
        for batch in batches:
            cases[("transformers", batch)] = transformers_case(model, anchor, batch, args, device)
    if args.continuous_batching:
        for batch in batches:
            cases[("transformers-cb", batch)] = continuous_batching_case(model, prompt, batch, args, device)
    timings = common.interleaved_rounds({f"{n} x{b}": with_peak(fn, device) for (n, b), fn in cases.items()},
                                        args.repeats, device)
    rows = []
    for (name, batch) in cases:
        runs = timings[f"{name} x{batch}"]
        seconds = statistics.median(r["seconds"] for r in runs)
        row = {"policy": name, "batch": batch, "seconds": seconds,  # a difference (transformers-cb) may be <= 0:
               "tokens_per_s": batch * tokens / seconds if seconds > 0 else None,  # noise swamped it, no rate
               "entries": args.length if name in ("full", "transformers", "transformers-cb") else args.budget,
               "peak_mib": max(r["peak_bytes"] for r in runs) / (1 << 20)}
        if "kv_cache_bytes" in runs[0]:
            row["kv_cache_mib"] = runs[0]["kv_cache_bytes"] / (1 << 20)
        if "seconds_with_prefill" in runs[0]:  # transformers-cb: decode = long run - 1-token run
            row["seconds_with_prefill"] = statistics.median(r["seconds_with_prefill"] for r in runs)
        rows.append(row)
    base = {row["policy"]: row["tokens_per_s"] for row in rows if row["batch"] == batches[0]}
    for row in rows:
        row["speedup_vs_batch_" + str(batches[0])] = common.ratio(row["tokens_per_s"], base.get(row["policy"]))
    common.print_table([("policy", 16), ("batch", 5), ("tok/s", 8), ("x batch " + str(batches[0]), 10),
                        ("KV MiB", 7), ("peak MiB", 8)],
                       [[r["policy"], str(r["batch"]), common.fmt(r["tokens_per_s"], ".1f"),
                         common.fmt(r["speedup_vs_batch_" + str(batches[0])], ".2f", "x"),
                         common.fmt(r.get("kv_cache_mib"), ".1f"), common.fmt(r["peak_mib"], ".0f")] for r in rows], 2)
    return rows


def serving_mode(model, names: list[str], args, device: str) -> list[dict]:
    """Per prompt length and policy: one prefill, then `held` sequences' worth of caches by forking it. `held` =
    --memory-gb over a sequence's cache bytes (the larger of the entry count and what a fork really allocates); the
    measured batch is min(held, --max-batch), with its caches' bytes, their projection to `held` and the verdict."""
    budget_bytes = args.memory_gb * (1 << 30)
    per_entry = common.kv_cache_bytes(None, model, 1)  # keys + values of one token, every layer and KV head
    rows = []
    for length in [int(x) for x in args.lengths.split(",")]:
        prompt = common.random_prompt(model, length).to(device)
        for name in names:
            common.release_memory(device)
            state = prefilled(model, prompt, name, args.budget, args.block_size)  # once per (L, policy)
            entries = length + args.new_tokens if name == "full" else args.budget + 1
            per_sequence = max(per_entry * entries, state.cache.kv_cache_bytes)
            held = int(budget_bytes // per_sequence)
            batch = min(held, args.max_batch)
            row = {"L": length, "policy": name, "entries_per_sequence": entries, "bytes_per_sequence": per_sequence,
                   "sequences_held": held, "measured_batch": batch, "tokens_per_s": None, "kv_cache_mib": None,
                   "kv_cache_mib_at_held": None, "within_budget": None}
            if batch >= 1:
                fn = with_peak(lambda: batched_decode(model, state.fork(batch), args.new_tokens, device), device)
                runs = next(iter(common.interleaved_rounds({f"{name} L={length} x{batch}": fn}, args.repeats,
                                                           device).values()))
                measured = max(r["kv_cache_bytes"] for r in runs)
                row.update(tokens_per_s=batch * (args.new_tokens - 1) / statistics.median(r["seconds"] for r in runs),
                           kv_cache_mib=measured / (1 << 20), kv_cache_mib_at_held=measured / batch * held / (1 << 20),
                           within_budget=measured / batch * held <= budget_bytes,
                           peak_mib=max(r["peak_bytes"] for r in runs) / (1 << 20))
            del state
            rows.append(row)
        full = next((r for r in rows if r["L"] == length and r["policy"] == "full"), None)
        for row in rows:
            if row["L"] == length and full is not None:
                row["sequences_vs_full"] = common.ratio(row["sequences_held"], full["sequences_held"])
                row["tokens_per_s_vs_full"] = common.ratio(row["tokens_per_s"], full["tokens_per_s"])
    common.print_table([("L", 6), ("policy", 10), ("held", 6), ("held x", 7), ("batch", 6), ("tok/s", 8),
                        ("tok/s x", 7), ("KV MiB", 7), ("at held", 8), ("budget MiB", 10)],
                       [[str(r["L"]), r["policy"], str(r["sequences_held"]),
                         common.fmt(r.get("sequences_vs_full"), ".1f", "x"), str(r["measured_batch"]),
                         common.fmt(r["tokens_per_s"], ".1f"), common.fmt(r.get("tokens_per_s_vs_full"), ".2f", "x"),
                         common.fmt(r["kv_cache_mib"], ".1f"), common.fmt(r["kv_cache_mib_at_held"], ".1f"),
                         f"{budget_bytes / (1 << 20):.0f}"] for r in rows], 2)
    return rows


def run(args) -> dict:
    names, device, dtype = args.names, args.device, args.torch_dtype
    fields = dict(model=args.model, attn=args.attn, N=args.budget, B=args.block_size, new_tokens=args.new_tokens,
                  repeats=args.repeats)
    fields.update({"lengths": args.lengths, "memory_gb": args.memory_gb} if args.serving
                  else {"L": args.length, "batches": args.batches})
    setting = common.setting_line(device, dtype, **fields)
    print(setting, flush=True)
    cb_note = continuous_batching_unavailable(device) if args.continuous_batching and not args.serving else None
    if cb_note:
        print(f"note: --continuous-batching skipped: {cb_note}", file=sys.stderr)
        args.continuous_batching = False
    announce(f"loading {args.model}")
    model = common.build_model(args.model, dtype, args.attn, device)
    if args.serving:
        rows = serving_mode(model, names, args, device)
        data = {"prompt": "random token ids per length (random_prompt, seed 0)", "prefill_included": False}
    else:
        prompt = common.random_prompt(model, args.length).to(device)
        rows = decode_mode(model, prompt, names, args, device)
        data = {**common.prompt_record(prompt), "prefill_included": False,
                "transformers_continuous_batching": cb_note or ("measured" if args.continuous_batching else "not run")}
    return {"mode": "serving" if args.serving else "decode", "setting": setting, "data": data, "results": rows}


CASE = runner.Case("throughput", run, __doc__, runner.RUN + ("policies", "new_tokens") + runner.SIZES,
                   defaults={"model": "smollm2-135m", "policies": "full,keydiff", "new_tokens": 18}, options=(
    runner.option("--batches", default="1,4,8,16", help="batch sizes (the first is the ratios' base)"),
    runner.option("--per-row", action="store_true",
                  help="also decode each bounded policy with generate_batch(group_rows=False): every row attends and "
                       "evicts on its own, as separately prefilled prompts do (forks of one prefill, the default "
                       "cases, attend and evict as one group)"),
    runner.option("--pooled", action="store_true",
                  help="also decode copies prefilled apart (own buffers) with pool_rows=True: each is moved into one "
                       "block as it joins (the copy timed) and they group like forks"),
    runner.option("--no-transformers", dest="transformers", action="store_false", help="skip the DynamicCache anchor"),
    runner.option("--continuous-batching", action="store_true",
                  help="also time transformers' generate_batch (paged full caches; prefill included)"),
    runner.option("--serving", action="store_true", help="sequences held and tokens/s within --memory-gb"),
    runner.option("--memory-gb", type=float, default=4.0, help="memory for the caches (--serving)"),
    runner.option("--lengths", default="4096,16384,32768", help="prompt lengths L (--serving)"),
    runner.option("--max-batch", type=int, default=128, help="largest batch actually decoded (--serving)")))


main = runner.entry(CASE, __spec__.name, __name__)  # `python -m keydiff.bench throughput`: this case
