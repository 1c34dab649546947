"""Every GPU row of the step's targets in one command (`make gpu-bench`), within about 8 minutes on an H100/H200.

On a random model of Llama-3.2-3B's shape in bfloat16 with sdpa (no download: shapes, not weights, set speed),
greedy, L = 4,096, N = 1,024, B = 128 unless a row says otherwise, each row beside its anchors measured in the
same process:

  decode     ms per step at batch 1 and 16: KeyDiff with the fixed-shape step (a CUDA graph replayed) and with
             the ordinary step; `full` (ours) at batch 16; transformers' eager DynamicCache loop; transformers'
             StaticCache under torch.compile(mode="reduce-overhead") (its compile time recorded); the floor
             (keydiff.bench.floor: weights + the rows' entries read once at the vendor's bandwidth, or the FLOPs at
             the measured matmul rate if larger; the rates are the row "device rates"); a run's own path at batch
             1, one keydiff.Decoder across calls (what a sample pays after the first, and the graphs captured);
             KeyDiff's fixed-shape step with batch_invariant=True (keydiff.kernels' fixed-order kernels) and its
             cost against the plain kernels (`x_plain`, steady steps: the number the "default on CUDA at <= 1.15x"
             rule of docs/performance.md needs)
  prefill    block-wise KeyDiff prefill (N = 2,048) at L = 32K for B = 64, 128, 256, 1,024 and at L = 128K for
             B = 128: seconds and peak GiB beyond the weights, beside one full forward (logits_to_keep=1); B = 128
             at 32K with the ordinary step too
  exact      the fixed-shape step gives the ordinary step's tokens (batch 1 and 16); with batch_invariant, the 16
             forks of one prompt decoded together give the tokens it gets at batch 1; batch 16 against each
             sequence alone for 16 prompts of 1.5K-3K tokens, 64 tokens, KeyDiff N = 512 and full: how many of 16
             identical (bf16: cuBLAS picks kernels by row count; see docs/gpu.md)
  serving    32K prompts, 16 GB for the caches: KeyDiff N = 1,024 sequences held and tokens/s

Rows run in that order and each is written to the JSON as soon as it is done, so a run cut short keeps what it
measured; a row that fails records its error and the others go on; `--deadline` skips what would start after it.
On a machine without CUDA, `--quick` runs every row at tiny sizes (what the tests do): the code paths, not the
numbers.

    python -m keydiff.bench.gpu_bench [--quick] [--json results/bench/gpu_bench.json] [--deadline 450]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import traceback
from dataclasses import dataclass

import torch

from keydiff import Decoder, Request, build_policy, generate, generate_batch, prefill
from keydiff.bench import common, floor

@dataclass(frozen=True)
class Sizes:
    model: str
    length: int  # decode rows' prompt
    budget: int  # decode rows' N
    block: int
    tokens: int  # decoded per decode row (timed: tokens - 1 steps)
    batch: int  # the large batch
    prefill_lengths: tuple[int, int]  # (the B sweep's L, the long L)
    prefill_budget: int
    prefill_blocks: tuple[int, ...]
    exact_lengths: tuple[int, int]  # the batch-invariance prompts' range
    exact_budget: int
    exact_tokens: int
    serving_length: int
    serving_gb: float
    serving_tokens: int
    compile_anchor: bool


FULL = Sizes("random-llama-3.2-3b", 4096, 1024, 128, 32, 16, (32768, 131072), 2048, (64, 128, 256, 1024),
             (1536, 3072), 512, 64, 32768, 16.0, 16, True)
# The floor's rates measured small on a CPU (--quick): the tests run them; a CPU's numbers mean nothing here.
CPU_RATES = {"read_mib": 64, "matmul_size": 256, "repeats": 2}
QUICK = Sizes("random-tiny", 256, 64, 16, 6, 4, (512, 1024), 64, (16, 32, 64), (96, 160), 32, 8, 512, 0.002, 4,
              False)  # B = 16 is in the sweep, as the paper's B = 128 is in FULL's


def timed(device: str, fn) -> tuple[float, object]:
    common.sync(device)
    start = time.perf_counter()
    out = fn()
    common.sync(device)
    return time.perf_counter() - start, out


def decode_seconds(model, states, tokens: int, fixed: bool, invariant: bool = False) -> tuple[float, list[list[int]]]:
    """Wall time of decoding `tokens` tokens for every state together (no stop tokens), and the tokens."""
    requests = [Request(state, max_new_tokens=tokens, key=i) for i, state in enumerate(states)]
    device = str(next(model.parameters()).device.type)
    seconds, out = timed(device, lambda: dict(generate_batch(model, requests, len(requests), fixed_shapes=fixed,
                                                             batch_invariant=invariant)))
    return seconds, [out[i].token_ids[0] for i in range(len(states))]


def transformers_static_ms(model, prompt, batch: int, tokens: int, device: str) -> dict:
    """transformers' StaticCache decode under torch.compile(mode="reduce-overhead"): ms per step after compiling
    (the prompt prefilled uncompiled, batch copies of it), and the compile (first two steps) time."""
    from transformers import StaticCache

    cache = StaticCache(config=model.config, max_cache_len=prompt.shape[1] + tokens + 2)
    ids = prompt.expand(batch, -1).to(device)
    with torch.inference_mode():
        logits = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1).logits
    step = torch.compile(lambda token, position: model(input_ids=token, position_ids=position, cache=cache,
                                                        use_cache=True).logits, mode="reduce-overhead", fullgraph=True)
    token = logits[:, -1].argmax(-1, keepdim=True)
    position = torch.full((batch, 1), prompt.shape[1], device=device)

    def one(token, position):
        with torch.inference_mode():
            out = step(token, position)[:, -1].argmax(-1, keepdim=True).clone()
        return out, position + 1

    compile_s, (token, position) = timed(device, lambda: one(*one(token, position)))
    seconds, _ = timed(device, lambda: [token := one(token, position + i)[0] for i in range(tokens - 1)])
    return {"ms_per_step": 1e3 * seconds / (tokens - 1), "compile_s": compile_s}


def steady(model, states_of, sizes: Sizes, fixed: bool, invariant: bool = False) -> tuple[dict, list[list[int]]]:
    """ms per step of decoding `sizes.tokens` and 2 x `sizes.tokens` tokens from fresh forks: `ms_per_step` over
    every step of the longer run (a generate call's first fixed step runs eagerly and the second captures the
    graph: what a call pays), `ms_per_step_steady` from the difference of the two runs (the replayed steps)."""
    decode_seconds(model, states_of(), 3, fixed, invariant)  # warm-up (and, with invariant, Triton's compiles)
    short, _ = decode_seconds(model, states_of(), sizes.tokens, fixed, invariant)
    long, tokens = decode_seconds(model, states_of(), 2 * sizes.tokens, fixed, invariant)
    return {"ms_per_step": 1e3 * long / (2 * sizes.tokens - 1),
            "ms_per_step_steady": 1e3 * (long - short) / sizes.tokens}, tokens


def decoder_rows(model, state, sizes: Sizes, device: str, floor_ms: float | None) -> list[dict]:
    """A run's own path at batch 1: one keydiff.Decoder kept across calls (the runner's RunContext.decoder), each
    call a fresh fork of the prompt decoding `sizes.tokens` tokens, as each sample of a run does. The first call
    captures the decode graph; `ms_per_step` is the median of the next calls' whole time per step (first steps,
    the move into the arena and the bookkeeping included: what every later sample pays), `first_call_ms_per_step`
    the first call's, `graphs` the decode graphs the decoder captured over all calls (1 where it replays), and
    `capture_failures` why a capture failed (its step then ran eagerly), if one did."""
    decoder, seconds, graphs = Decoder(model, 1), [], []
    for _ in range(4):
        fork = state.fork(1)[0]
        seconds.append(timed(device, lambda: generate(model, fork, sizes.tokens, decoder=decoder))[0])
        for _, step in decoder.stepper.steps.values():
            if step.graph is not None and all(step.graph is not known for known in graphs):
                graphs.append(step.graph)  # kept, not their ids: a freed graph's id may be reused
    per_step = [1e3 * s / (sizes.tokens - 1) for s in seconds]
    return [{"row": "decode", "case": "keydiff, one decoder across calls", "batch": 1,
             "ms_per_step": statistics.median(per_step[1:]), "first_call_ms_per_step": per_step[0],
             "graphs": len(graphs), "capture_failures": decoder.graphs.reasons, "floor_ms": floor_ms}]


def decode_rows(model, sizes: Sizes, device: str) -> list[dict]:
    from keydiff.bench.throughput import transformers_case, transformers_prefill

    prompt = common.random_prompt(model, sizes.length).to(device)
    steps = sizes.tokens - 1
    rates = floor.measure(device, next(model.parameters()).dtype, **({} if device == "cuda" else CPU_RATES))
    rows = [{"row": "decode", "case": "device rates", **rates.record()}]

    def floor_ms(batch: int, entries: int) -> float | None:
        return floor.floor_ms(model, batch, entries, rates)["floor_ms"]

    state = prefill(model, prompt, build_policy("keydiff"), sizes.budget, sizes.block)
    rows += decoder_rows(model, state, sizes, device, floor_ms(1, sizes.budget + 1))
    full = prefill(model, prompt, build_policy("full"), None, sizes.block)
    invariant_tokens = {}
    for batch in (1, sizes.batch):
        tokens, steady_ms = {}, {}
        for fixed in (True, False):
            timing, tokens[fixed] = steady(model, lambda: state.fork(batch), sizes, fixed)
            steady_ms[fixed] = timing["ms_per_step_steady"]
            rows.append({"row": "decode", "case": f"keydiff {'fixed' if fixed else 'ordinary'}", "batch": batch,
                         **timing, "floor_ms": floor_ms(batch, sizes.budget + 1)})
        rows.append({"row": "exact", "case": "fixed step = ordinary step, keydiff", "batch": batch,
                     "identical": sum(a == b for a, b in zip(tokens[True], tokens[False])), "of": batch})
        plain = steady_ms[True]
        timing, invariant_tokens[batch] = steady(model, lambda: state.fork(batch), sizes, True, invariant=True)
        rows.append({"row": "decode", "case": "keydiff fixed, batch_invariant", "batch": batch, **timing,
                     "x_plain": timing["ms_per_step_steady"] / plain if plain > 0 else None,
                     "floor_ms": floor_ms(batch, sizes.budget + 1)})
    rows.append({"row": "exact", "case": f"batch_invariant: forks at batch {sizes.batch} = batch 1, keydiff",
                 "batch": sizes.batch,
                 "identical": sum(t == invariant_tokens[1][0] for t in invariant_tokens[sizes.batch]),
                 "of": sizes.batch})
    timing, _ = steady(model, lambda: full.fork(sizes.batch), sizes, True)
    rows.append({"row": "decode", "case": "full (ours)", "batch": sizes.batch, **timing,
                 "floor_ms": floor_ms(sizes.batch, sizes.length + 2 * sizes.tokens)})
    del full, state
    common.release_memory(device)
    anchor = transformers_prefill(model, prompt, device)
    args = argparse.Namespace(new_tokens=sizes.tokens)
    for batch in (1, sizes.batch):
        run = transformers_case(model, anchor, batch, args, device)
        run()
        rows.append({"row": "decode", "case": "transformers eager DynamicCache", "batch": batch,
                     "ms_per_step": 1e3 * run()["seconds"] / steps})
    del anchor
    common.release_memory(device)
    if sizes.compile_anchor and device == "cuda":
        for batch in (1, sizes.batch):
            rows.append({"row": "decode", "case": "transformers StaticCache + compile(reduce-overhead)", "batch": batch,
                         **transformers_static_ms(model, prompt, batch, sizes.tokens, device)})
            common.release_memory(device)
    return rows


def peak_beyond(device: str, fn) -> tuple[float, float | None]:
    """(seconds, peak GiB allocated beyond what was allocated before) of fn()."""
    common.release_memory(device)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    seconds, out = timed(device, fn)
    del out
    peak = (torch.cuda.max_memory_allocated() - base) / (1 << 30) if device == "cuda" else None
    return seconds, peak


def prefill_rows(model, sizes: Sizes, device: str) -> list[dict]:
    rows = []
    sweep, long = sizes.prefill_lengths
    policy = lambda: build_policy("keydiff")  # noqa: E731
    prefill(model, common.random_prompt(model, 4 * sizes.prefill_budget).to(device), policy(), sizes.prefill_budget,
            sizes.block)  # warm-up
    for length, blocks in ((sweep, sizes.prefill_blocks), (long, (sizes.block,))):
        prompt = common.random_prompt(model, length).to(device)
        for block in blocks:
            for fixed in ((True, False) if block == sizes.block and length == sweep else (True,)):
                seconds, peak = peak_beyond(device, lambda: prefill(model, prompt, policy(), sizes.prefill_budget,
                                                                    block, fixed_shapes=fixed))
                rows.append({"row": "prefill", "case": f"keydiff {'fixed' if fixed else 'ordinary'}", "L": length,
                             "N": sizes.prefill_budget, "B": block, "seconds": seconds, "peak_gib_beyond": peak})
        with torch.inference_mode():
            seconds, peak = peak_beyond(device, lambda: model(input_ids=prompt, logits_to_keep=1).logits)
        rows.append({"row": "prefill", "case": "one full forward", "L": length, "seconds": seconds,
                     "peak_gib_beyond": peak})
        common.release_memory(device)
    by_block = {r["B"]: r["seconds"] for r in rows if r.get("L") == sweep and r["case"] == "keydiff fixed"}
    largest = max(by_block)
    for row in rows:
        if row.get("L") == sweep and row["case"] == "keydiff fixed":
            row["x_largest_block"] = row["seconds"] / by_block[largest]
    return rows


def invariance_rows(model, sizes: Sizes, device: str) -> list[dict]:
    """Batch `sizes.batch` against each sequence alone, greedy: identical sequences out of the batch."""
    low, high = sizes.exact_lengths
    lengths = torch.linspace(low, high, sizes.batch).round().long().tolist()
    prompts = [common.random_prompt(model, n, seed=i).to(device) for i, n in enumerate(lengths)]
    rows = []
    for name, budget in (("keydiff", sizes.exact_budget), ("full", None)):
        def states():
            return [prefill(model, p, build_policy(name), budget, sizes.block) for p in prompts]

        alone = [generate(model, s, sizes.exact_tokens).token_ids[0] for s in states()]
        requests = [Request(s, max_new_tokens=sizes.exact_tokens, key=i) for i, s in enumerate(states())]
        together = dict(generate_batch(model, requests, sizes.batch))
        same = sum(together[i].token_ids[0] == alone[i] for i in range(len(prompts)))
        rows.append({"row": "exact", "case": f"batch {sizes.batch} = alone, {name}", "batch": sizes.batch,
                     "identical": same, "of": len(prompts), "tokens": sizes.exact_tokens})
        common.release_memory(device)
    return rows


def serving_rows(model, sizes: Sizes, device: str) -> list[dict]:
    prompt = common.random_prompt(model, sizes.serving_length).to(device)
    state = prefill(model, prompt, build_policy("keydiff"), sizes.budget, sizes.block)
    held = int(sizes.serving_gb * (1 << 30) // state.cache.kv_cache_bytes)
    decode_seconds(model, state.fork(held), 3, True)
    seconds, _ = decode_seconds(model, state.fork(held), sizes.serving_tokens, True)
    return [{"row": "serving", "case": "keydiff", "L": sizes.serving_length, "N": sizes.budget,
             "memory_gb": sizes.serving_gb, "sequences_held": held,
             "tokens_per_s": held * (sizes.serving_tokens - 1) / seconds}]


def print_rows(rows: list[dict]) -> None:
    keys = ["row", "case", "batch", "L", "B", "ms_per_step", "ms_per_step_steady", "x_plain", "floor_ms", "seconds",
            "x_largest_block",
            "peak_gib_beyond", "first_call_ms_per_step", "graphs", "identical", "of", "sequences_held", "tokens_per_s", "compile_s", "error"]
    shown = [k for k in keys if any(k in r for r in rows)]
    cell = lambda v: "-" if v is None else f"{v:.3g}" if isinstance(v, float) else str(v)  # noqa: E731
    common.print_table([(k, 0) for k in shown], [[cell(r.get(k)) for k in shown] for r in rows], text_columns=2)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny sizes (any device): the code paths, not numbers")
    parser.add_argument("--json", default=None, help="write the rows and their provenance here, after every row")
    parser.add_argument("--deadline", type=float, default=450.0, help="seconds after which no new row group starts")
    parser.add_argument("--rows", default="decode,prefill,exact,serving", help="which row groups, in this order")
    args = parser.parse_args(argv)
    groups = {"decode": decode_rows, "prefill": prefill_rows, "exact": invariance_rows, "serving": serving_rows}
    chosen = [g.strip() for g in args.rows.split(",") if g.strip()]
    unknown = [g for g in chosen if g not in groups]
    if unknown:
        parser.error(f"unknown row groups {unknown}; valid: {', '.join(groups)}")
    started = common.provenance(__spec__.name, argv)
    device = common.device_name()
    if device != "cuda" and not args.quick:
        parser.error("no CUDA device here: the GPU rows need one (--quick runs them at tiny sizes anywhere)")
    sizes = QUICK if args.quick else FULL
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    begin = time.perf_counter()
    model = common.build_model(sizes.model, dtype, "sdpa", device)
    print(common.setting_line(device, dtype, model=sizes.model, quick=args.quick), flush=True)
    rows: list[dict] = []
    for group in chosen:
        elapsed = time.perf_counter() - begin
        if elapsed > args.deadline:
            rows.append({"row": group, "case": "skipped", "error": f"deadline: {elapsed:.0f} s > {args.deadline:.0f} s"})
            continue
        print(f"{group} ... ({elapsed:.0f} s so far)", file=sys.stderr, flush=True)
        try:
            with torch.inference_mode():
                rows += groups[group](model, sizes, device)
        except Exception as error:  # one group's failure must not lose the others' numbers
            traceback.print_exc()
            rows.append({"row": group, "case": "failed", "error": f"{type(error).__name__}: {error}"[:300]})
        common.release_memory(device)
        if args.json:
            common.write_json(args.json, {"device": device, "sizes": sizes.__dict__, "rows": rows,
                                          "wall_s": time.perf_counter() - begin}, started)
    print_rows(rows)
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
