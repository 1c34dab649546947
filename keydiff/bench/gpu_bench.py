"""Every GPU row of the step's targets in one command (`make gpu-bench`), within about 8 minutes on an H100/H200.

Groups decode, prefill, exact and serving, on a random model of Llama-3.2-3B's shape in bfloat16 (L = 4,096,
N = 1,024, B = 128 unless a row says otherwise), each row beside its anchors measured in the same process.
Captured steps are timed as a first call pays them (`first_call_*`) and at steady state (`ms_per_step`). The
rows of `planned_rows(sizes)` are always written, in order, each as soon as it is done (failed or past
--deadline: written as such). Without CUDA, --quick runs every row tiny with CPU stand-ins: code paths only.

    python -m keydiff.bench gpu_bench [--quick] [--json results/bench/gpu_bench.json] [--deadline 450]

Design: docs/design/benchmarks.md#every-gpu-row-in-one-command-gpu_bench
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from keydiff import Decoder, Request, build_policy, generate, generate_batch, prefill
from keydiff.bench import common, floor, runner


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
    prefill_blocks: tuple[int, ...]  # the sweep's B, `block` among them
    exact_lengths: tuple[int, int]  # the batch-invariance prompts' range
    exact_budget: int
    exact_tokens: int
    serving_length: int
    serving_gb: float
    serving_tokens: int


FULL = Sizes("random-llama-3.2-3b", 4096, 1024, 128, 32, 16, (32768, 131072), 2048, (64, 128, 256, 1024),
             (1536, 3072), 512, 64, 32768, 16.0, 16)
# The floor's rates measured small on a CPU (--quick): the tests run them; a CPU's numbers mean nothing here.
CPU_RATES = {"read_mib": 64, "matmul_size": 256, "repeats": 2}
# The same rows as FULL's (planned_rows): as many prefill blocks, `block` second among them as FULL's B = 128.
QUICK = Sizes("random-tiny", 256, 64, 16, 6, 4, (512, 1024), 64, (8, 16, 32, 64), (96, 160), 32, 8, 512, 0.002, 4)
GROUPS = ("decode", "prefill", "exact", "serving")
STATIC_CASE = "transformers StaticCache + compile(reduce-overhead)"
IDENTITY = ("row", "case", "batch", "L", "B")  # the fields that name a row (the others are its measurements)


def planned_rows(sizes: Sizes) -> list[tuple[str, dict]]:
    """(group, the row's identity) for every row a run of these sizes writes, in order: the same list on CUDA and
    under --quick on a CPU, whatever fails (a failed row keeps its identity, with its error)."""
    big, sweep, long = sizes.batch, *sizes.prefill_lengths
    decode = [{"row": "decode", "case": "device rates"},
              {"row": "decode", "case": "keydiff, one decoder across calls", "batch": 1}]
    for batch in (1, big):
        decode += [{"row": "decode", "case": "keydiff fixed", "batch": batch},
                   {"row": "decode", "case": "keydiff ordinary", "batch": batch},
                   {"row": "exact", "case": "fixed step = ordinary step, keydiff", "batch": batch},
                   {"row": "decode", "case": "keydiff fixed, batch_invariant", "batch": batch}]
    decode += [{"row": "exact", "case": f"batch_invariant: forks at batch {big} = batch 1, keydiff", "batch": big},
               {"row": "decode", "case": "full (ours)", "batch": big}]
    decode += [{"row": "decode", "case": "transformers eager DynamicCache", "batch": b} for b in (1, big)]
    decode += [{"row": "decode", "case": STATIC_CASE, "batch": b} for b in (1, big)]
    prefill_ = []
    for length, blocks in ((sweep, sizes.prefill_blocks), (long, (sizes.block,))):
        for block in blocks:
            steps = ("fixed", "ordinary") if block == sizes.block and length == sweep else ("fixed",)
            prefill_ += [{"row": "prefill", "case": f"keydiff {step}", "L": length, "B": block} for step in steps]
        prefill_.append({"row": "prefill", "case": "one full forward", "L": length})
    exact = [{"row": "exact", "case": f"batch {big} = alone, {name}", "batch": big} for name in ("keydiff", "full")]
    serving = [{"row": "serving", "case": "keydiff", "L": sizes.serving_length}]
    return ([("decode", r) for r in decode] + [("prefill", r) for r in prefill_] + [("exact", r) for r in exact]
            + [("serving", r) for r in serving])


def identity(row: dict) -> dict:
    return {k: row[k] for k in IDENTITY if k in row}


def cpu_stand_ins(device: str, fail: str | None = None):
    """On a CPU, keydiff.decode.static's stand-in for CUDA graph capture (the steps capture and replay there as
    on CUDA, so --quick runs the lines a GPU runs; `fail`: its captures fail so, as the tests ask); nothing on
    CUDA."""
    if device == "cuda":
        return contextlib.nullcontext()
    from keydiff.decode.static import stand_in_graphs

    return stand_in_graphs(fail=fail)


def graph_record(decoder: Decoder) -> dict:
    """What a decoder's captures cost: graphs captured, the seconds spent capturing and warming up for it, the
    bytes the graph pool holds (keydiff.decode.static.StepStats' counts: on CUDA the reserved memory each capture
    added, under the CPU stand-in the bytes its captures allocated), and why a capture failed, if one did."""
    record = decoder.stats.record()
    return {"graphs": record["captured"], "capture_s": record["capture_s"], "warm_up_s": record["warm_up_s"],
            "graph_pool_bytes": record["pool_bytes"], "capture_failures": record["reasons"]}


def decode_seconds(model, states, tokens: int, decoder: Decoder) -> tuple[float, list[list[int]]]:
    """Wall time of decoding `tokens` tokens for every state together through `decoder` (no stop tokens), and
    the tokens."""
    requests = [Request(state, max_new_tokens=tokens, key=i) for i, state in enumerate(states)]
    device = str(next(model.parameters()).device.type)
    seconds, out = common.timed(device, lambda: dict(decoder.generate(requests)))
    return seconds, [out[i].token_ids[0] for i in range(len(states))]


def steady(model, states_of, sizes: Sizes, fixed: bool, invariant: bool = False) -> tuple[dict, list[list[int]]]:
    """ms per step of decoding forks (`states_of()`, fresh each call) through one Decoder, after an untimed warm-up
    through another: `first_call_ms_per_step` (a fresh decoder's first call, capture included), `ms_per_step` (a
    later call of 2 x `sizes.tokens`), `ms_per_step_steady` (its difference with a call of `sizes.tokens`)."""
    width = len(states_of())
    options = dict(fixed_shapes=fixed, batch_invariant=invariant)
    decode_seconds(model, states_of(), 3, Decoder(model, width, **options))
    decoder = Decoder(model, width, **options)
    first, _ = decode_seconds(model, states_of(), sizes.tokens, decoder)
    graphs = graph_record(decoder)
    short, _ = decode_seconds(model, states_of(), sizes.tokens, decoder)
    long, tokens = decode_seconds(model, states_of(), 2 * sizes.tokens, decoder)
    return {"ms_per_step": 1e3 * long / (2 * sizes.tokens - 1),
            "ms_per_step_steady": 1e3 * (long - short) / sizes.tokens,
            "first_call_ms_per_step": 1e3 * first / (sizes.tokens - 1), **graphs}, tokens


def compile_options(device: str) -> dict:
    """torch.compile's options for the StaticCache anchor: reduce-overhead (CUDA graphs) on CUDA; on a CPU, which
    has no CUDA graphs, the same fullgraph trace run eagerly (backend="eager": the lines and the graph, in
    seconds rather than inductor's minutes)."""
    return {"mode": "reduce-overhead"} if device == "cuda" else {"backend": "eager"}


def transformers_static_ms(model, prompt, batch: int, tokens: int, device: str) -> dict:
    """transformers' StaticCache decode under torch.compile(fullgraph=True, `compile_options`): ms per step after
    compiling (the prompt prefilled uncompiled, batch copies of it), and the compile (first two steps) time."""
    from transformers import StaticCache

    cache = StaticCache(config=model.config, max_cache_len=prompt.shape[1] + tokens + 2)
    ids = prompt.expand(batch, -1).to(device)
    with torch.inference_mode():
        logits = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1).logits
    options = compile_options(device)
    step = torch.compile(lambda token, position: model(input_ids=token, position_ids=position, cache=cache,
                                                        use_cache=True).logits, fullgraph=True, **options)
    token = logits[:, -1].argmax(-1, keepdim=True)
    position = torch.full((batch, 1), prompt.shape[1], device=device)

    def one(token, position):
        with torch.inference_mode():
            out = step(token, position)[:, -1].argmax(-1, keepdim=True).clone()
        return out, position + 1

    def loop(token, position, steps: int):
        for _ in range(steps):
            token, position = one(token, position)
        return token, position

    compile_s, (token, position) = common.timed(device, lambda: loop(token, position, 2))
    seconds, _ = common.timed(device, lambda: loop(token, position, tokens - 1))
    return {"ms_per_step": 1e3 * seconds / (tokens - 1), "compile_s": compile_s,
            "compile": ", ".join(f"{k}={v}" for k, v in options.items())}


def decoder_rows(model, state, sizes: Sizes, device: str, floor_ms: float | None) -> Iterator[dict]:
    """A run's own path at batch 1: one keydiff.Decoder kept across calls, each a fresh fork of the prompt.
    `ms_per_step`: median of the calls after the first (everything a later sample pays); `first_call_ms_per_step`;
    `graphs` captured over all calls (1 where it replays); `capture_failures` why a capture failed, if one did."""
    decoder, seconds = Decoder(model, 1), []
    for _ in range(4):
        fork = state.fork(1)[0]
        seconds.append(common.timed(device, lambda: generate(model, fork, sizes.tokens, decoder=decoder))[0])
    per_step = [1e3 * s / (sizes.tokens - 1) for s in seconds]
    yield {"row": "decode", "case": "keydiff, one decoder across calls", "batch": 1,
           "ms_per_step": statistics.median(per_step[1:]), "first_call_ms_per_step": per_step[0],
           **graph_record(decoder), "floor_ms": floor_ms}


def decode_rows(model, sizes: Sizes, device: str) -> Iterator[dict]:
    from keydiff.bench.throughput import transformers_case, transformers_prefill

    prompt = common.random_prompt(model, sizes.length).to(device)
    steps = sizes.tokens - 1
    rates = floor.measure(device, next(model.parameters()).dtype, **({} if device == "cuda" else CPU_RATES))
    yield {"row": "decode", "case": "device rates", **rates.record()}

    def floor_ms(batch: int, entries: int) -> float | None:
        return floor.floor_ms(model, batch, entries, rates)["floor_ms"]

    state = prefill(model, prompt, build_policy("keydiff"), sizes.budget, sizes.block)
    yield from decoder_rows(model, state, sizes, device, floor_ms(1, sizes.budget + 1))
    full = prefill(model, prompt, build_policy("full"), None, sizes.block)
    invariant_tokens = {}
    for batch in (1, sizes.batch):
        tokens, steady_ms = {}, {}
        for fixed in (True, False):
            timing, tokens[fixed] = steady(model, lambda: state.fork(batch), sizes, fixed)
            steady_ms[fixed] = timing["ms_per_step_steady"]
            yield {"row": "decode", "case": f"keydiff {'fixed' if fixed else 'ordinary'}", "batch": batch,
                   **timing, "tokens_per_s": per_second(batch, timing["ms_per_step"]),
                   "floor_ms": floor_ms(batch, sizes.budget + 1)}
        yield {"row": "exact", "case": "fixed step = ordinary step, keydiff", "batch": batch,
               "identical": sum(a == b for a, b in zip(tokens[True], tokens[False])), "of": batch}
        plain = steady_ms[True]
        timing, invariant_tokens[batch] = steady(model, lambda: state.fork(batch), sizes, True, invariant=True)
        yield {"row": "decode", "case": "keydiff fixed, batch_invariant", "batch": batch, **timing,
               "x_plain": timing["ms_per_step_steady"] / plain if plain > 0 else None,
               "floor_ms": floor_ms(batch, sizes.budget + 1)}
    yield {"row": "exact", "case": f"batch_invariant: forks at batch {sizes.batch} = batch 1, keydiff",
           "batch": sizes.batch, "identical": sum(t == invariant_tokens[1][0] for t in invariant_tokens[sizes.batch]),
           "of": sizes.batch}
    timing, _ = steady(model, lambda: full.fork(sizes.batch), sizes, True)
    yield {"row": "decode", "case": "full (ours)", "batch": sizes.batch, **timing,
           "tokens_per_s": per_second(sizes.batch, timing["ms_per_step"]),
           "floor_ms": floor_ms(sizes.batch, sizes.length + 2 * sizes.tokens)}
    del full, state
    release_memory(device)
    anchor = transformers_prefill(model, prompt, device)
    args = argparse.Namespace(new_tokens=sizes.tokens)
    for batch in (1, sizes.batch):
        run = transformers_case(model, anchor, batch, args, device)
        run()
        yield {"row": "decode", "case": "transformers eager DynamicCache", "batch": batch,
               "ms_per_step": 1e3 * run()["seconds"] / steps}
    del anchor
    release_memory(device)
    for batch in (1, sizes.batch):
        yield {"row": "decode", "case": STATIC_CASE, "batch": batch,
               **transformers_static_ms(model, prompt, batch, sizes.tokens, device)}
        release_memory(device)


def per_second(sequences: int, ms_per_step: float) -> float | None:
    return 1e3 * sequences / ms_per_step if ms_per_step > 0 else None


def peak_beyond(device: str, fn) -> tuple[float, float | None]:
    """(seconds, peak GiB allocated beyond what was allocated before) of fn()."""
    release_memory(device)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    seconds, out = common.timed(device, fn)
    del out
    peak = (torch.cuda.max_memory_allocated() - base) / (1 << 30) if device == "cuda" else None
    return seconds, peak


def prefill_timing(model, prompt, sizes: Sizes, block: int, fixed: bool, device: str) -> dict:
    """A prompt's block-wise KeyDiff prefill through one Decoder, twice: `first_call_seconds` (fresh: warm-up and
    capture included; `peak_gib_beyond` its peak beyond what was allocated before), then `seconds` (replayed, what later
    prompts pay)."""
    decoder = Decoder(model, 1, fixed_shapes=fixed)

    def run():
        return prefill(model, prompt, build_policy("keydiff"), sizes.prefill_budget, block, decoder=decoder)

    first, peak = peak_beyond(device, run)
    graphs = graph_record(decoder)
    seconds, _ = peak_beyond(device, run)
    return {"seconds": seconds, "first_call_seconds": first, "peak_gib_beyond": peak, **graphs}


def prefill_rows(model, sizes: Sizes, device: str) -> Iterator[dict]:
    sweep, long = sizes.prefill_lengths
    prefill(model, common.random_prompt(model, 4 * sizes.prefill_budget).to(device), build_policy("keydiff"),
            sizes.prefill_budget, sizes.block)  # warm-up
    by_block: dict[int, dict] = {}
    for length, blocks in ((sweep, sizes.prefill_blocks), (long, (sizes.block,))):
        prompt = common.random_prompt(model, length).to(device)
        for block in blocks:
            for fixed in ((True, False) if block == sizes.block and length == sweep else (True,)):
                row = {"row": "prefill", "case": f"keydiff {'fixed' if fixed else 'ordinary'}", "L": length,
                       "N": sizes.prefill_budget, "B": block,
                       **prefill_timing(model, prompt, sizes, block, fixed, device)}
                if fixed and length == sweep:
                    by_block[block] = row
                    if len(by_block) == len(sizes.prefill_blocks):  # each sweep row against the largest block's
                        largest = by_block[max(by_block)]["seconds"]  # (rows written already: rewritten with it)
                        for measured in by_block.values():
                            measured["x_largest_block"] = measured["seconds"] / largest
                yield row
        with torch.inference_mode():
            seconds, peak = peak_beyond(device, lambda: model(input_ids=prompt, logits_to_keep=1).logits)
        yield {"row": "prefill", "case": "one full forward", "L": length, "seconds": seconds, "peak_gib_beyond": peak}
        release_memory(device)


def invariance_rows(model, sizes: Sizes, device: str) -> Iterator[dict]:
    """Batch `sizes.batch` against each sequence alone, greedy: identical sequences out of the batch."""
    low, high = sizes.exact_lengths
    lengths = torch.linspace(low, high, sizes.batch).round().long().tolist()
    prompts = [common.random_prompt(model, n, seed=i).to(device) for i, n in enumerate(lengths)]
    for name, budget in (("keydiff", sizes.exact_budget), ("full", None)):
        def states():
            return [prefill(model, p, build_policy(name), budget, sizes.block) for p in prompts]

        alone = [generate(model, s, sizes.exact_tokens).token_ids[0] for s in states()]
        requests = [Request(s, max_new_tokens=sizes.exact_tokens, key=i) for i, s in enumerate(states())]
        together = dict(generate_batch(model, requests, sizes.batch))
        same = sum(together[i].token_ids[0] == alone[i] for i in range(len(prompts)))
        yield {"row": "exact", "case": f"batch {sizes.batch} = alone, {name}", "batch": sizes.batch,
               "identical": same, "of": len(prompts), "tokens": sizes.exact_tokens}
        release_memory(device)


def serving_rows(model, sizes: Sizes, device: str) -> Iterator[dict]:
    """KeyDiff sequences of `serving_length`-token prompts held in `serving_gb`, counting each sequence's cache and
    its share of the decode graph's memory pool (measured at width min(batch, held) first: the pool grows with the
    width), then decoded together through one Decoder: the first call (capture included) and a later one."""
    prompt = common.random_prompt(model, sizes.serving_length).to(device)
    state = prefill(model, prompt, build_policy("keydiff"), sizes.budget, sizes.block)
    memory = sizes.serving_gb * (1 << 30)
    cache_bytes = state.cache.kv_cache_bytes
    probe = max(1, min(sizes.batch, int(memory // cache_bytes)))
    decoder = Decoder(model, probe)
    decode_seconds(model, state.fork(probe), 3, decoder)
    graph_bytes = graph_record(decoder)["graph_pool_bytes"] / probe
    del decoder
    release_memory(device)
    held = max(1, int(memory // (cache_bytes + graph_bytes)))
    decoder = Decoder(model, held)
    first, _ = decode_seconds(model, state.fork(held), sizes.serving_tokens, decoder)
    graphs = graph_record(decoder)
    seconds, _ = decode_seconds(model, state.fork(held), sizes.serving_tokens, decoder)
    steps = sizes.serving_tokens - 1
    yield {"row": "serving", "case": "keydiff", "L": sizes.serving_length, "N": sizes.budget,
           "memory_gb": sizes.serving_gb, "sequences_held": held, "cache_bytes_per_sequence": cache_bytes,
           "graph_bytes_per_sequence": graph_bytes, **graphs,
           "fits": held * cache_bytes + graphs["graph_pool_bytes"] <= memory,
           "tokens_per_s": held * steps / seconds, "first_call_tokens_per_s": held * steps / first,
           "ms_per_step": 1e3 * seconds / steps, "first_call_ms_per_step": 1e3 * first / steps}


ROWS: dict[str, Callable[..., Iterator[dict]]] = {"decode": decode_rows, "prefill": prefill_rows,
                                                  "exact": invariance_rows, "serving": serving_rows}
COLUMNS = ["row", "case", "batch", "L", "B", "ms_per_step", "ms_per_step_steady", "first_call_ms_per_step",
           "x_plain", "floor_ms", "seconds", "first_call_seconds", "x_largest_block", "peak_gib_beyond", "capture_s",
           "warm_up_s",
           "graphs", "graph_pool_bytes", "identical", "of", "sequences_held", "tokens_per_s",
           "first_call_tokens_per_s", "compile_s", "error"]


def cell(value) -> str:
    return "-" if value is None else f"{value:.3g}" if isinstance(value, float) else str(value)


def row_line(row: dict) -> str:
    """One finished row as one line (printed as it finishes; the table comes at the end)."""
    return "  ".join(f"{k}={cell(row[k])}" if k not in ("row", "case") else str(row[k]) for k in COLUMNS if k in row)


def print_rows(rows: list[dict]) -> None:
    shown = [k for k in COLUMNS if any(k in r for r in rows)]
    common.print_table([(k, 0) for k in shown], [[cell(r.get(k)) for k in shown] for r in rows], text_columns=2)


CLEANUP_ERRORS: list[str] = []


def release_memory(device: str) -> None:
    """common.release_memory, whose failure (an allocator left mid-capture by a failed capture asserts in
    empty_cache) is kept, to be written as a row, instead of ending the run."""
    try:
        common.release_memory(device)
    except Exception as error:  # noqa: BLE001 - reported as a row by `run_group`
        CLEANUP_ERRORS.append(common.first_line(error))


def run_group(group: str, planned: list[dict], make_rows: Callable[[], Iterator[dict]], log: common.RowLog,
              on_row: Callable[[dict], None] | None = None, deadline: Callable[[], str | None] = lambda: None) -> None:
    """Log the group's rows as they come; the first failure at its row (identity, error type and first line) and the
    later rows as skipped, as are those left when `deadline()` stops new rows. on_row sees each row before it is
    logged; what it raises is raised in the group (the tests' way to fail or stop a group in its middle)."""
    done = 0
    try:
        rows = make_rows()
        for row in rows:
            if done >= len(planned) or identity(row) != planned[done]:
                raise RuntimeError(f"row {identity(row)} is not the one planned: "
                                   f"{planned[done] if done < len(planned) else 'none'}")
            if on_row is not None:
                try:
                    on_row(row)
                except BaseException as error:  # noqa: BLE001 - raised where the row was made
                    rows.throw(error)
            log.add(row)
            done += 1
            late = deadline() if done < len(planned) else None
            if late:
                rows.close()
                for later in planned[done:]:
                    log.add({**later, "error": f"skipped: {late}", "skipped": True})
                break
    except Exception as error:  # noqa: BLE001 - one row's failure must not lose the rows measured before it
        traceback.print_exc()
        if done < len(planned):
            log.add({**planned[done], "group": group, "error": common.first_line(error)})
            for later in planned[done + 1:]:
                log.add({**later, "error": f"skipped: {planned[done]['case']!r} failed before it", "skipped": True})
        else:
            log.add({"row": group, "case": "failed", "group": group, "error": common.first_line(error)})
    release_memory(log.payload()["device"])
    while CLEANUP_ERRORS:
        log.add({"row": group, "case": "release_memory", "group": group, "error": CLEANUP_ERRORS.pop(0)})


def check(args) -> None:
    unknown = [g for g in (g.strip() for g in args.rows.split(",")) if g and g not in ROWS]
    if unknown:
        raise ValueError(f"unknown row groups {unknown}; valid: {', '.join(GROUPS)}")
    if common.device_name() != "cuda" and not args.quick:
        raise ValueError("no CUDA device here: the GPU rows need one (--quick runs them at tiny sizes anywhere)")


def run(args, on_row: Callable[[dict], None] | None = None, capture_fail: str | None = None) -> int:
    """on_row: see `run_group`; capture_fail: the CPU stand-in's captures fail so ("end", "inside"). Tests only.
    Exit status 1 where a row failed or a capture failed (its steps then ran eagerly: timings not of replayed
    graphs)."""
    chosen = [g.strip() for g in args.rows.split(",") if g.strip()]
    device = common.device_name()
    sizes = QUICK if args.quick else FULL
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    begin = time.perf_counter()
    model = common.build_model(sizes.model, dtype, "sdpa", device)
    print(common.setting_line(device, dtype, model=sizes.model, quick=args.quick), flush=True)
    log = common.RowLog(args.json, args.started, lambda: {"device": device, "sizes": sizes.__dict__,
                                                          "wall_s": time.perf_counter() - begin}, row_line)
    planned = planned_rows(sizes)
    def late() -> str | None:
        elapsed = time.perf_counter() - begin
        return f"deadline {args.deadline:.0f} s passed ({elapsed:.0f} s)" if elapsed > args.deadline else None

    for group in chosen:
        rows = [r for g, r in planned if g == group]
        if late():
            for row in rows:
                log.add({**row, "error": f"skipped: {late()}", "skipped": True})
            continue
        print(f"{group} ... ({time.perf_counter() - begin:.0f} s so far)", file=sys.stderr, flush=True)
        with torch.inference_mode(), cpu_stand_ins(device, capture_fail):
            run_group(group, rows, lambda: ROWS[group](model, sizes, device), log, on_row, late)
    log.write()
    print_rows(log.rows)
    failed = sorted({reason for row in log.rows for reason in row.get("capture_failures") or ()})
    for reason in failed:
        print(f"capture failed, its steps ran eagerly (those rows time no replayed graph): {reason}", flush=True)
    return 1 if failed or any("error" in r for r in log.rows) else 0


CASE = runner.Case("gpu_bench", run, __doc__, ("json",), check=check, options=(
    runner.option("--quick", action="store_true", help="tiny sizes (any device): the code paths, not numbers"),
    runner.option("--deadline", type=float, default=450.0, help="seconds after which no new row starts"),
    runner.option("--rows", default=",".join(GROUPS), help="which row groups, in this order")))


main = runner.entry(CASE, __spec__.name, __name__)  # `python -m keydiff.bench gpu_bench`: this case
