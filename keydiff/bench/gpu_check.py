"""Self-check to run first on a new machine (`make gpu-check`): is the engine exact here, and does it run?

Rows (PASS/FAIL/INFO/SKIP): full = forward, N+B bound, N >= L = full, plain loop, stacked = per layer,
batch 4 = alone, fixed = ordinary, one graph per run, batch 16 = alone, needle alone = in a batch,
fast ~ materialized, FA2 vs SDPA, two GPUs; then both benchmarks on Llama-3.2-3B's shape. On CUDA in bf16 for
each attention kernel on a tiny and a mid-size random Llama; on CPU the tiny model, the rest SKIP. Logits are
compared relative to max |reference logit| (1e-4 in float32, 5e-2 in bfloat16). Each row is written to the JSON
as it finishes. Exit status 1 if any row FAILs; --quick shrinks every size (the tests run it on CPU).

    python -m keydiff.bench.gpu_check [--quick] [--threads 1] [--json check.json] [--deadline 420]

Design: docs/design/benchmarks.md#the-self-check-gpu_check
"""

from __future__ import annotations

import argparse
import inspect
import json
import logging
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator

import torch

import keydiff
from keydiff import available_policies, generate, prefill
from keydiff.bench import common
from keydiff.config import STATISTICS_MODES
from keydiff.cli import ArgumentParser

TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 5e-2}
# Fast vs materialized kept-set agreement required in bf16. Random weights give near-uniform attention, so
# bf16 rounding flips many near-ties: measured on CPU, correct code agrees 0.85-1.0 (tiny and mid-size
# models), a statistic taken over the wrong query rows 0.1-0.5.
AGREEMENT_THRESHOLD = 0.75
GREEDY_POLICIES = ("keydiff", "sink", "tova", "snapkv")
AGREEMENT_POLICIES = ("h2o", "tova", "snapkv")
STACKED_POLICIES = ("keydiff", "tova", "snapkv", "h2o")
STACKED_AGREEMENT = 0.99
EVICTING = [name for name in available_policies() if name != "full"]
PREFILL, DECODE = "keydiff.bench.prefill", "keydiff.bench.decode"  # the benchmarks it runs, as `python -m` names


@dataclass
class Row:
    check: str
    setting: str
    result: str  # PASS | FAIL | SKIP | INFO (a measurement with no pass mark yet: it fails nothing)
    detail: str
    record: dict | None = None  # what the row ran on, where it says more than its detail (the needle rows)


@dataclass
class Sizes:
    length: int  # prompt tokens L
    budget: int  # N (> 32: SnapKV's window)
    block: int  # B for the eviction checks
    new_tokens: int


SIZES = {"random-tiny": Sizes(300, 64, 32, 12), "random-mid": Sizes(1024, 256, 64, 16)}
QUICK_SIZES = {"random-tiny": Sizes(160, 48, 32, 6), "random-mid": Sizes(256, 64, 32, 6)}
FULL_CHECK_BLOCK = 64


def relative_error(logits: torch.Tensor, reference: torch.Tensor) -> float:
    return ((logits.float() - reference.float()).abs().max() / reference.float().abs().max().clamp_min(1e-6)).item()


def cache_takes_argument() -> bool:
    """True once keydiff_attention(model, cache) exists, i.e. a plain model loop can drive the cache."""
    return len(inspect.signature(keydiff.keydiff_attention).parameters) >= 2


def compare(check: str, setting: str, errors: dict[str, float], tol: float) -> Row:
    worst = max(errors, key=errors.get)
    ok = all(err <= tol for err in errors.values())
    detail = f"rel. max |diff| {errors[worst]:.1e} (worst: {worst}), tol {tol:.0e}"
    return Row(check, setting, "PASS" if ok else "FAIL", detail)


def check_full_equals_forward(model, prompt, setting, tol) -> Row:
    with torch.inference_mode():
        reference = model(prompt).logits[:, -1].float()
    state = prefill(model, prompt, "full", None, FULL_CHECK_BLOCK)
    row = compare("full = forward", setting, {"full": relative_error(state.logits, reference)}, tol)
    row.detail = f"B={FULL_CHECK_BLOCK}, L={prompt.shape[1]}: {row.detail}"
    return row


def check_bound(model, prompt, sizes: Sizes, setting) -> Row:
    """After every block each layer holds <= N; the peak is <= N + B in prefill and while decoding."""
    budget, block = sizes.budget, sizes.block
    failures, peaks = [], []
    has_hook = "on_block" in inspect.signature(prefill).parameters
    for name in EVICTING:
        sizes_after = []

        def after_block(cache):
            sizes_after.append(max(layer.num_entries for layer in cache.layers))  # entries held, not tokens seen

        kwargs = {"on_block": after_block} if has_hook else {}
        state = prefill(model, prompt, name, budget, block, **kwargs)
        result = generate(model, state, sizes.new_tokens)
        peak = max(state.max_cache_entries, result.max_cache_entries)
        peaks.append(peak)
        if peak > budget + block or any(size > budget for size in sizes_after):
            failures.append(f"{name} (peak {peak}, after-block max {max(sizes_after, default='?')})")
    detail = f"{len(EVICTING)} policies, N={budget} B={block}: peak {max(peaks)} <= N+B={budget + block}"
    if not has_hook:
        detail += " (prefill has no on_block: per-block sizes not checked)"
    return Row("N+B bound", setting, "FAIL" if failures else "PASS", "; ".join(failures) or detail)


def check_large_budget_is_full(model, prompt, sizes: Sizes, setting, tol) -> Row:
    length = prompt.shape[1]
    full = prefill(model, prompt, "full", None, sizes.block).logits
    errors, short = {}, []
    for name in EVICTING:
        state = prefill(model, prompt, name, length, sizes.block)
        errors[name] = relative_error(state.logits, full)
        if any(p.shape[-1] != length for p in state.kept_positions):
            short.append(name)
    row = compare("N >= L = full", setting, errors, tol)
    if short:
        row.result, row.detail = "FAIL", f"evicted with N = L: {', '.join(short)}; {row.detail}"
    return row


@torch.inference_mode()
def plain_greedy_loop(model, state, new_tokens: int) -> list[int]:
    """What a user writes without keydiff.generate: feed the argmax back, the cache does the rest."""
    token, tokens = state.logits.argmax(-1), []
    with keydiff.keydiff_attention(model, state.cache):
        for step in range(new_tokens):
            tokens.append(int(token[0]))
            if step == new_tokens - 1:
                break
            output = model(input_ids=token[:, None], cache=state.cache, use_cache=True)
            token = output.logits[:, -1].argmax(-1)
    return tokens


def check_plain_loop(model, prompt, sizes: Sizes, setting) -> Row:
    if not cache_takes_argument():
        return Row("plain loop = generate", setting, "SKIP",
                   "keydiff.keydiff_attention(model) takes no cache argument yet (engine before the rewrite)")
    mismatched = []
    for name in GREEDY_POLICIES:
        expected = generate(model, prefill(model, prompt, name, sizes.budget, sizes.block), sizes.new_tokens)
        got = plain_greedy_loop(model, prefill(model, prompt, name, sizes.budget, sizes.block), sizes.new_tokens)
        if got != expected.token_ids[0]:
            mismatched.append(name)
    detail = f"{', '.join(GREEDY_POLICIES)}: {sizes.new_tokens} greedy tokens"
    return Row("plain loop = generate", setting, "FAIL" if mismatched else "PASS",
               f"differ: {', '.join(mismatched)}" if mismatched else detail + " identical")


def kept_agreement(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """Share of kept entries (per layer and KV head, compared as position sets) present in both runs."""
    shared = [(x[..., :, None] == y[..., None, :]).any(-1).float().mean() for x, y in zip(a, b)]
    return torch.stack(shared).mean().item()


def check_statistics_agreement(model, prompt, sizes: Sizes, setting) -> Row:
    rates = {}
    for name in AGREEMENT_POLICIES:
        runs = [prefill(model, prompt, name, sizes.budget, sizes.block, attention_statistics=mode).kept_positions
                for mode in STATISTICS_MODES]
        rates[name] = kept_agreement(*runs)
    ok = min(rates.values()) >= AGREEMENT_THRESHOLD
    detail = ", ".join(f"{k} {v:.3f}" for k, v in rates.items()) + f" (threshold {AGREEMENT_THRESHOLD})"
    return Row("fast ~ materialized", setting, "PASS" if ok else "FAIL", detail)


def check_stacked_equals_layer_by_layer(model, prompt, sizes: Sizes, setting) -> Row:
    rates, tokens_differ = {}, []
    for name in STACKED_POLICIES:
        policy = keydiff.build_policy(name)
        states = [prefill(model, prompt, p, sizes.budget, sizes.block) for p in (policy, keydiff.layer_by_layer(policy))]
        if states[0].cache.stack is None:
            return Row("stacked = per layer", setting, "FAIL", f"{name}: the cache was not stacked")
        rates[name] = kept_agreement(states[0].kept_positions, states[1].kept_positions)
        generated = [generate(model, state, sizes.new_tokens).token_ids for state in states]
        if generated[0] != generated[1]:
            tokens_differ.append(name)
    # Identical tokens are required only where the kept sets are identical: one differing entry may flip a token.
    ok = min(rates.values()) >= STACKED_AGREEMENT and not [name for name in tokens_differ if rates[name] == 1.0]
    detail = ", ".join(f"{k} {v:.3f}" for k, v in rates.items()) + f" kept-set agreement (>= {STACKED_AGREEMENT})"
    if tokens_differ:
        detail += f"; tokens differ: {', '.join(tokens_differ)}"
    return Row("stacked = per layer", setting, "PASS" if ok else "FAIL", detail)


def check_flash_against_sdpa(model_name, sizes: Sizes, dtype) -> Row:
    setting = f"{model_name} {short(dtype)}"
    sdpa = common.build_model(model_name, dtype, "sdpa", "cuda")
    flash = common.build_model(model_name, dtype, "flash_attention_2", "cuda")
    flash.load_state_dict(sdpa.state_dict())
    prompt = common.random_prompt(sdpa, sizes.length).cuda()
    errors, diffs = {}, []
    for name in ("full", "keydiff", "snapkv"):
        budget = None if name == "full" else sizes.budget
        a, b = (prefill(m, prompt, name, budget, sizes.block).logits for m in (sdpa, flash))
        errors[name] = relative_error(b, a)
        diffs.append((b - a).abs().max().item())
    row = compare("FA2 vs SDPA logits", setting, errors, TOLERANCE[dtype])
    row.detail = f"max |diff| {max(diffs):.3g}; {row.detail}"
    return row


def short(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype]


def guarded(check: str, setting: str, fn, *args) -> Row:
    """A crashing check is a FAIL row with the error, so the rest of the self-check still runs."""
    try:
        return fn(*args)
    except Exception as error:  # noqa: BLE001 - report every failure as a row
        return Row(check, setting, "FAIL", common.first_line(error, 240))



BATCH_POLICIES = ("keydiff", "tova", "snapkv", "full")


def check_batch_equals_separate(model, prompt, sizes: Sizes, setting) -> Row:
    """keydiff.generate_batch at batch 4 against each sequence decoded alone: four prompts of different lengths
    (one shorter than N) per policy, greedy. Prefills run alone and attention runs row by row, so only the
    batched projections and MLPs can round differently from batch 1 (cuBLAS may pick other kernels for 4 rows
    than for 1): a FAIL names the sequences whose tokens differ."""
    lengths = [prompt.shape[1], prompt.shape[1] * 3 // 4, prompt.shape[1] // 2, max(8, sizes.budget // 2)]
    identical = total = 0
    failures = []
    for name in BATCH_POLICIES:
        states = [prefill(model, prompt[:, :n], name, sizes.budget, sizes.block) for n in lengths]
        alone = [generate(model, state.fork(1)[0], sizes.new_tokens) for state in states]
        requests = [keydiff.Request(state, max_new_tokens=sizes.new_tokens, key=i) for i, state in enumerate(states)]
        batched = dict(keydiff.generate_batch(model, requests, batch_size=len(requests)))
        for i, single in enumerate(alone):
            total += 1
            if batched[i].token_ids == single.token_ids:
                identical += 1
                continue
            failures.append(f"{name} L={lengths[i]}")
    detail = f"{', '.join(BATCH_POLICIES)} x L={lengths}: {identical}/{total} sequences identical at batch 4"
    return Row("batch 4 = alone", setting, "PASS" if identical == total else "FAIL",
               detail + (f"; differ: {', '.join(failures)}" if failures else ""))


STATISTIC_FIXED = ("tova", "snapkv", "h2o")  # in fixed shapes as one sequence alone (never pooled into a block)


def check_fixed_equals_ordinary(model, prompt, sizes: Sizes, setting) -> Row:
    """The fixed-shape step (keydiff.batching.static; on CUDA a replayed CUDA graph) against the ordinary step:
    same kept positions, logits and tokens, bit for bit (the graph replays the eager step's kernels). KeyDiff:
    prefill, 4 forks, one alone; attention-statistic policies: prefill and one alone.
    """
    on, off = (prefill(model, prompt, "keydiff", sizes.budget, sizes.block, fixed_shapes=f) for f in (True, False))
    kept_same = all(torch.equal(a, b) for a, b in zip(on.kept_positions, off.kept_positions))
    logits_same = torch.equal(on.logits, off.logits)
    tokens = {}
    for fixed in (True, False):
        forks = prefill(model, prompt, "keydiff", sizes.budget, sizes.block).fork(4)
        requests = [keydiff.Request(f, max_new_tokens=sizes.new_tokens, key=i) for i, f in enumerate(forks)]
        batched = dict(keydiff.generate_batch(model, requests, batch_size=4, fixed_shapes=fixed))
        alone = generate(model, prefill(model, prompt, "keydiff", sizes.budget, sizes.block), sizes.new_tokens,
                         fixed_shapes=fixed)
        tokens[fixed] = [batched[i].token_ids for i in range(4)] + [alone.token_ids]
    same = sum(a == b for a, b in zip(tokens[True], tokens[False]))
    ok = kept_same and logits_same and same == 5
    detail = (f"prefill: kept {'=' if kept_same else '!='}, logits {'=' if logits_same else '!='}; "
              f"decode: {same}/5 sequences identical (4 forks together, 1 alone)")
    differ = []
    for name in STATISTIC_FIXED:
        on, off = (prefill(model, prompt, name, sizes.budget, sizes.block, fixed_shapes=f) for f in (True, False))
        equal = (all(torch.equal(a, b) for a, b in zip(on.kept_positions, off.kept_positions))
                 and torch.equal(on.logits, off.logits)
                 and generate(model, on, sizes.new_tokens, fixed_shapes=True).token_ids
                 == generate(model, off, sizes.new_tokens, fixed_shapes=False).token_ids)
        if not equal:
            differ.append(name)
    detail += (f"; {', '.join(STATISTIC_FIXED)} (prefill, 1 alone): "
               + (f"differ: {', '.join(differ)}" if differ else "identical"))
    return Row("fixed = ordinary", setting, "PASS" if ok and not differ else "FAIL", detail)


def check_one_graph_per_run(model, prompt, sizes: Sizes, setting, stood_in: bool = False) -> Row:
    """A run's Decoder (keydiff.batching.scheduler) keeps its arena, its prefill slot and their fixed-shape steps
    across its calls: three prompts of different lengths, prefilled and decoded one call each through one Decoder
    of width 1 (as a run at batch 1 does its samples), replay one decode graph and one block graph between them
    and give the ordinary step's logits and tokens."""
    if prompt.device.type != "cuda" and not stood_in:  # a CPU captures through keydiff.batching.static's stand-in for CUDA graphs
        from keydiff.batching.static import stand_in_graphs

        with stand_in_graphs():
            row = check_one_graph_per_run(model, prompt, sizes, setting, stood_in=True)
        row.detail += " (CUDA graphs stood in for on the CPU)"
        return row
    # The graphs themselves are kept (not their ids: a freed graph's id may be reused by the next one).
    decoder, decode_graphs, block_graphs, same = keydiff.Decoder(model, 1), [], [], 0

    def add(graphs: list, graph) -> None:
        if graph is not None and all(graph is not known for known in graphs):
            graphs.append(graph)
    for i in range(3):
        ids = prompt[:, : prompt.shape[1] - 5 * i]  # every one >= N + B: each fills its own N + B slots
        reference = prefill(model, ids, "keydiff", sizes.budget, sizes.block, fixed_shapes=False)
        want = (reference.logits, generate(model, reference, sizes.new_tokens, fixed_shapes=False).token_ids)
        state = prefill(model, ids, "keydiff", sizes.budget, sizes.block, decoder=decoder)
        got = (state.logits, generate(model, state, sizes.new_tokens, decoder=decoder).token_ids)
        same += torch.equal(got[0], want[0]) and got[1] == want[1]
        for _, step in decoder.stepper.steps.values():
            add(decode_graphs, step.graph)
        if decoder.blocks.step is not None:
            add(block_graphs, decoder.blocks.step.graph)
    ok = same == 3 and len(decode_graphs) == 1 and len(block_graphs) == 1
    return Row("one graph per run", setting, "PASS" if ok else "FAIL",
               f"3 prompts, one call each: {len(decode_graphs)} decode and {len(block_graphs)} prefill-block CUDA "
               f"graph(s) captured, {same}/3 identical to the ordinary step (prefill logits, tokens)"
               + (f"; captures failed: {decoder.graphs.reasons}" if decoder.graphs.failed else ""))


def check_batch_invariance(model_name: str, dtype: torch.dtype, device: str, batch: int, tokens: int,
                           lengths: tuple[int, int], budget: int, batch_invariant: bool = False) -> Row:
    """`batch` prompts decoded together against each alone (greedy; KeyDiff at N = budget, and full) on a real shape.

    fp32 with TF32 off: all identical (PASS/FAIL); bf16: a count (INFO); bf16 with `batch_invariant`: all identical.
    """
    matmul_tf32 = torch.backends.cuda.matmul.allow_tf32 if device == "cuda" else None
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
    try:
        model = common.build_model(model_name, dtype, "sdpa", device)
        low, high = lengths
        sizes = torch.linspace(low, high, batch).round().long().tolist()
        prompts = [common.random_prompt(model, n, seed=i).to(device) for i, n in enumerate(sizes)]
        counts = []
        for name, n in (("keydiff", budget), ("full", None)):
            alone = [generate(model, prefill(model, p, name, n, 128), tokens, batch_invariant=batch_invariant).token_ids
                     for p in prompts]
            requests = [keydiff.Request(prefill(model, p, name, n, 128), max_new_tokens=tokens, key=i)
                        for i, p in enumerate(prompts)]
            together = dict(keydiff.generate_batch(model, requests, batch_size=batch, batch_invariant=batch_invariant))
            counts.append((name, sum(together[i].token_ids == alone[i] for i in range(batch))))
        del model
    finally:
        if device == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = matmul_tf32
            torch.cuda.empty_cache()
    exact = all(same == batch for _, same in counts)
    detail = f"{batch} prompts of {low}-{high} tokens, {tokens} tokens: " + ", ".join(
        f"{name} {same}/{batch} identical" for name, same in counts)
    claimed = dtype == torch.float32 or batch_invariant
    result = ("PASS" if exact else "FAIL") if claimed else ("PASS" if exact else "INFO")
    setting = f"{model_name.removeprefix('random-')} sdpa {short(dtype)}" + (", batch_invariant" if batch_invariant else "")
    return Row(f"batch {batch} = alone", setting, result, detail)


def versions() -> dict:
    """What a batch-invariance result depends on: the GPU, its driver, CUDA, torch and Triton (None on a CPU)."""
    cuda = torch.cuda.is_available()
    driver = None
    if cuda:
        try:
            driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                    capture_output=True, text=True, timeout=30).stdout.strip().splitlines()[0]
        except (OSError, IndexError, subprocess.SubprocessError):
            driver = None
    triton = None
    if cuda:
        try:
            import triton as triton_module

            triton = triton_module.__version__
        except ImportError:
            pass
    return {"gpu": torch.cuda.get_device_name() if cuda else None, "driver": driver,
            "cuda": torch.version.cuda if cuda else None, "torch": torch.__version__, "triton": triton}


@dataclass(frozen=True)
class Needle:
    """The needle checks' sizes: a prompt of `length` tokens decoded alone and among `others` prompts of `lengths`
    tokens, `tokens` tokens, KeyDiff N = `budget`."""
    model: str
    dtype: torch.dtype
    others: int
    length: int
    lengths: tuple[int, int]
    tokens: int
    budget: int


NEEDLE = Needle("random-llama-3.2-3b", torch.bfloat16, 15, 2048, (1536, 3072), 32, 512)
QUICK_NEEDLE = Needle("random-tiny", torch.float32, 15, 128, (96, 160), 6, 48)
NEEDLE_SEED = 36
# check_batch_invariance's (model, batch, tokens, prompt lengths, N): on CUDA, and on a CPU or under --quick.
BATCH16 = ("random-llama-3.2-3b", 16, 32, (1536, 3072), 512)
QUICK_BATCH16 = ("random-tiny", 16, 5, (96, 160), 48)  # the needle's position among the others is drawn with it (and recorded)


def needle_outputs(model, needle, others: list, position: int, sizes: Needle,
                   batch_invariant: bool) -> tuple[list, list]:
    """The needle's tokens decoded alone and at `position` among `others` (prefilled states, forked for each
    decode), each greedy and sampled (temperature 1, a fixed seed: a draw near a boundary turns on the logits' last
    bits): ([greedy, sampled] alone, [greedy, sampled] together)."""
    def requests(states: list, sample: bool) -> list:
        return [keydiff.Request(s.fork(1)[0], max_new_tokens=sizes.tokens, key=i, do_sample=sample,
                                seed=NEEDLE_SEED if sample else None) for i, s in enumerate(states)]

    batch = others[:position] + [needle] + others[position:]
    alone, together = [], []
    for sample in (False, True):
        (_, single), = keydiff.generate_batch(model, requests([needle], sample), 1, batch_invariant=batch_invariant)
        alone.append(single.token_ids)
        out = dict(keydiff.generate_batch(model, requests(batch, sample), len(batch), batch_invariant=batch_invariant))
        together.append(out[position].token_ids)
    return alone, together


def check_needle(sizes: Needle, device: str, seed: int = NEEDLE_SEED) -> list[Row]:
    """Batch invariance as vLLM checks it: a needle prompt alone and at a seeded random position among
    `sizes.others` prompts with batch_invariant=True (PASS/FAIL), and the same with the mode off as a negative
    control (INFO); each row records its `versions`.
    """
    model = common.build_model(sizes.model, sizes.dtype, "sdpa", device)
    low, high = sizes.lengths
    lengths = torch.linspace(low, high, sizes.others).round().long().tolist()
    def prefilled(length: int, seed: int):
        return prefill(model, common.random_prompt(model, length, seed=seed).to(device), "keydiff", sizes.budget, 128)

    others = [prefilled(n, i) for i, n in enumerate(lengths)]
    needle = prefilled(sizes.length, 1000)
    position = random.Random(seed).randrange(sizes.others + 1)
    setting = f"{sizes.model.removeprefix('random-')} sdpa {short(sizes.dtype)}, keydiff N={sizes.budget}"
    record = {"seed": seed, "position": position, "batch": sizes.others + 1, "tokens": sizes.tokens,
              "needle_length": sizes.length, "other_lengths": [low, high], **versions()}
    what = (f"a needle of {sizes.length} tokens alone and at position {position} of {sizes.others + 1} "
            f"(seed {seed}), {sizes.tokens} tokens greedy and sampled")
    rows = []
    same = {}
    for invariant in (True, False):
        alone, together = needle_outputs(model, needle, others, position, sizes, invariant)
        same[invariant] = [a == t for a, t in zip(alone, together)]
    on, off = all(same[True]), all(same[False])
    rows.append(Row("needle alone = in a batch", setting + ", batch_invariant", "PASS" if on else "FAIL",
                    f"{what}: {'identical' if on else 'differ (greedy, sampled: ' + str(same[True]) + ')'}",
                    {**record, "batch_invariant": True, "identical": same[True]}))
    control = ("differ: the mode off changes the needle's output here, so the check above can fail and means "
               "something" if not off else "identical with the mode off too: on this machine the batch_invariant "
               "check proves nothing")
    rows.append(Row("needle control (mode off)", setting, "INFO", f"{what}: {control}",
                    {**record, "batch_invariant": False, "identical": same[False], "proves_nothing": off}))
    del model
    return rows


def engine_checks(model_name: str, dtype: torch.dtype, attn: str, device: str, sizes: Sizes) -> Iterator[Row]:
    setting = f"{model_name.removeprefix('random-')} {attn} {short(dtype)}"
    print(f"  checking {setting} ...", file=sys.stderr, flush=True)
    try:
        model = common.build_model(model_name, dtype, attn, device)
    except Exception as error:  # noqa: BLE001 - e.g. a flash-attn that cannot load: one FAIL row, go on
        yield Row("engine checks", setting, "FAIL", f"cannot build the model: {common.first_line(error, 200)}")
        return
    prompt = common.random_prompt(model, sizes.length).to(device)
    tol = TOLERANCE[dtype]
    yield guarded("full = forward", setting, check_full_equals_forward, model, prompt, setting, tol)
    yield guarded("N+B bound", setting, check_bound, model, prompt, sizes, setting)
    yield guarded("N >= L = full", setting, check_large_budget_is_full, model, prompt, sizes, setting, tol)
    yield guarded("plain loop = generate", setting, check_plain_loop, model, prompt, sizes, setting)
    yield guarded("stacked = per layer", setting, check_stacked_equals_layer_by_layer, model, prompt, sizes, setting)
    yield guarded("batch 4 = alone", setting, check_batch_equals_separate, model, prompt, sizes, setting)
    yield guarded("fixed = ordinary", setting, check_fixed_equals_ordinary, model, prompt, sizes, setting)
    yield guarded("one graph per run", setting, check_one_graph_per_run, model, prompt, sizes, setting)
    if dtype == torch.bfloat16 and attn != "eager":  # eager computes both modes from the same weights
        yield guarded("fast ~ materialized", setting, check_statistics_agreement, model, prompt, sizes, setting)


def split_over_gpus(model, devices: list[str]):
    """The model's decoder layers split in contiguous halves over `devices` (embeddings with the first, the
    final norm and head with the last), as accelerate's device_map=auto places a model too large for one GPU."""
    from accelerate import dispatch_model

    layers = model.config.num_hidden_layers
    device_map = {"model.embed_tokens": devices[0], "model.rotary_emb": devices[0], "model.norm": devices[-1],
                  "lm_head": devices[-1]}
    for i in range(layers):
        device_map[f"model.layers.{i}"] = devices[i * len(devices) // layers]
    return dispatch_model(model, device_map=device_map)


def check_two_gpus(sizes: Sizes, devices: tuple[str, ...] = ("cuda:0", "cuda:1"), model_name: str = "random-mid",
                   dtype: torch.dtype = torch.bfloat16) -> Row:
    """The mid-size model split over two GPUs (the tests run it split over the CPU twice, one stack expected)."""
    setting = f"{model_name.removeprefix('random-')} sdpa {short(dtype)}, layers over {' and '.join(devices)}"
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if devices[0].startswith("cuda") and count < 2:
        return Row("two GPUs", setting, "SKIP", f"needs 2+ GPUs: {count} visible")
    model = split_over_gpus(common.build_model(model_name, dtype, "sdpa", "cpu"), list(devices))
    prompt = common.random_prompt(model, sizes.length).to(devices[0])
    with torch.inference_mode():
        reference = model(prompt).logits[:, -1].float()
    failures = []
    error = relative_error(prefill(model, prompt, "full", None, FULL_CHECK_BLOCK).logits.cpu(), reference.cpu())
    if error > TOLERANCE[dtype]:
        failures.append(f"full vs forward {error:.1e}")
    state = prefill(model, prompt, "keydiff", sizes.budget, sizes.block)
    cache = state.cache
    for i, layer in enumerate(cache.layers):
        expected = next(model.model.layers[i].parameters()).device
        if layer.keys.device != expected:
            failures.append(f"layer {i} cache on {layer.keys.device}, layer on {expected}")
    stacks = sorted((str(s.keys.device), s.count) for s in cache.storages)
    if len(stacks) != len(set(devices)):
        failures.append(f"storages {stacks}: expected one stack per GPU")
    expected_tokens = generate(model, state, sizes.new_tokens).token_ids[0]
    if cache.max_entries > sizes.budget + sizes.block:
        failures.append(f"peak {cache.max_entries} > N+B")
    tokens = plain_greedy_loop(model, prefill(model, prompt, "keydiff", sizes.budget, sizes.block), sizes.new_tokens)
    if tokens != expected_tokens:
        failures.append("plain loop tokens differ from generate's")
    detail = f"full vs forward {error:.1e}; stacks {stacks}; peak {cache.max_entries} <= N+B; loop = generate"
    return Row("two GPUs", setting, "FAIL" if failures else "PASS", "; ".join(failures) or detail)


def flash_attn_status() -> tuple[str, str]:
    """('ok' | 'missing' | 'old', message): FA2 rows run only with flash_attn >= 2.1 (bottom-right causal mask)."""
    try:
        import flash_attn
    except ImportError:
        return "missing", "flash_attn is not importable (pip install -e '.[flash]' --no-build-isolation)"
    from packaging.version import Version

    version = getattr(flash_attn, "__version__", "0")
    if Version(version) < Version("2.1"):
        return "old", (f"flash_attn {version} < 2.1: it aligns the causal mask top-left when queries < keys, "
                       "which is wrong for block prefill against a cache; upgrade flash-attn")
    return "ok", f"flash_attn {version}"


def benchmark_row(module: str, label: str, arguments: list[str]) -> Row:
    """Run a benchmark in a fresh interpreter; PASS if it exits 0 with a positive time for every policy."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bench.json"
        done = common.run_module(module, [*arguments, "--json", str(out)])
        if done.returncode != 0 or not out.exists():
            tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
            return Row(module, label, "FAIL", f"exit {done.returncode}: {tail[:200]}")
        results = json.loads(out.read_text())["results"]
    if module == PREFILL:
        times = [r["ttft_median_s"] for r in results]
        summary = "TTFT x full: " + ", ".join(f"{r['policy']} {common.fmt(r['ratio_to_full'], '.2f')}" for r in results)
    else:
        times = [r["decode_ms_per_token"] for r in results]
        summary = "ms/token x full@N: " + ", ".join(
            f"{r['policy']} {common.fmt(r.get('decode_ratio_to_full'), '.2f')}" for r in results)
    ok = bool(results) and all(t > 0 for t in times)
    return Row(module, label, "PASS" if ok else "FAIL", summary)


def benchmark_rows(device: str, quick: bool) -> Iterator[Row]:
    tiny = ["--model", "random-tiny", "--length", "128", "--budget", "40", "--block-size", "16", "--repeats", "1",
            "--threads", "1"]  # a smoke run: one thread cannot be stalled by a busy machine
    if device != "cuda" or quick:
        yield benchmark_row(PREFILL, "random-tiny, tiny sizes", tiny + ["--reference"])
        yield benchmark_row(DECODE, "random-tiny, tiny sizes", tiny + ["--new-tokens", "4", "--profile-tokens", "3"])
    if device != "cuda":
        for module in (PREFILL, DECODE):
            yield Row(module, "random-llama-3.2-3b", "SKIP", "CUDA only: no GPU here (ran tiny sizes above)")
    elif quick:
        for module in (PREFILL, DECODE):
            yield Row(module, "random-llama-3.2-3b", "SKIP", "--quick: tiny sizes only")
    else:
        big = ["--model", "random-llama-3.2-3b", "--dtype", "bfloat16", "--repeats", "3"]
        yield benchmark_row(PREFILL, "3b bf16 L=8192 N=2048 B=128",
                            big + ["--length", "8192", "--budget", "2048", "--block-size", "128", "--reference"])
        yield benchmark_row(DECODE, "3b bf16 L=4096 N=1024 32 tokens",
                            big + ["--length", "4096", "--budget", "1024", "--new-tokens", "32"])


def checks(quick: bool) -> Iterator[Row]:
    """Every row, each as soon as it is done (main writes it at once)."""
    device = common.device_name()
    sizes = QUICK_SIZES if quick else SIZES
    if device == "cuda":
        status, message = flash_attn_status()
        attns = ["sdpa", "eager"] + (["flash_attention_2"] if status == "ok" else [])
        if status != "ok":
            yield Row("flash_attention_2", "all", "FAIL" if status == "old" else "SKIP", message)
        for model_name in ("random-tiny", "random-mid"):
            for attn in attns:
                yield from engine_checks(model_name, torch.bfloat16, attn, device, sizes[model_name])
            if status == "ok":
                yield guarded("FA2 vs SDPA logits", model_name, check_flash_against_sdpa, model_name,
                              sizes[model_name], torch.bfloat16)
    else:
        for dtype in (torch.float32, torch.bfloat16):
            for attn in ("sdpa", "eager"):
                yield from engine_checks("random-tiny", dtype, attn, device, sizes["random-tiny"])
        yield Row("engine checks", "mid sdpa/eager/fa2 bf16", "SKIP", "CUDA only: no GPU here")
        yield Row("flash_attention_2", "all", "SKIP", "CUDA only: flash-attn needs a GPU")
        yield Row("FA2 vs SDPA logits", "tiny, mid bf16", "SKIP", "CUDA only: flash-attn needs a GPU")
    yield guarded("two GPUs", "mid sdpa bf16", check_two_gpus, sizes["random-mid"])
    # A real model's shape on CUDA: 16 prompts of 1.5K-3K tokens, fp32, bf16, bf16 batch_invariant; elsewhere and
    # under --quick the same rows on the tiny model (the code paths; a CPU's kernels are batch-invariant already).
    model_name, *shape = (BATCH16 if device == "cuda" and not quick else QUICK_BATCH16)
    for dtype, invariant in ((torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)):
        setting = f"{model_name.removeprefix('random-')} sdpa {short(dtype)}" + (", batch_invariant" if invariant else "")
        yield guarded("batch 16 = alone", setting, check_batch_invariance, model_name, dtype, device, *shape, invariant)
    needle = QUICK_NEEDLE if quick or device != "cuda" else NEEDLE
    try:
        yield from check_needle(needle, device)
    except Exception as error:  # noqa: BLE001 - a crashing check is a FAIL row
        yield Row("needle alone = in a batch", needle.model, "FAIL", common.first_line(error, 240))
    yield from benchmark_rows(device, quick)


def run_checks(quick: bool) -> list[Row]:
    return list(checks(quick))


def print_rows(rows: list[Row]) -> None:
    common.print_table([("check", 0), ("setting", 0), ("result", 0), ("detail", 0)],
                       [[r.check, r.setting, r.result, r.detail] for r in rows], text_columns=4)


def row_line(row: dict) -> str:
    return f"  {row['result']:<4}  {row['check']}  [{row['setting']}]  {row['detail']}"


class HeldWarnings(logging.Handler):
    """keydiff's warnings while the checks run (a policy run without its tokenizer, a budget too small for its
    window: expected of checks that run every policy on made-up prompts), held so that they do not split the
    table, then printed after it, each distinct one once."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: dict[str, None] = {}

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.setdefault(record.getMessage())

    def __enter__(self) -> "HeldWarnings":
        package = logging.getLogger("keydiff")
        self.propagated, package.propagate = package.propagate, False
        package.addHandler(self)
        return self

    def __exit__(self, *exc: object) -> None:
        package = logging.getLogger("keydiff")
        package.removeHandler(self)
        package.propagate = self.propagated


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny sizes everywhere (what the tests run)")
    parser.add_argument("--json", default=None, help="also write the rows and the environment to this file, after "
                                                     "every row")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads for the engine checks")
    parser.add_argument("--deadline", type=float, default=None,
                        help="seconds after which no new check starts (the rest: one SKIP row); default: none")
    args = parser.parse_args(argv)
    started = common.provenance(__spec__.name, argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = common.device_name()
    print(common.setting_line(device, None, transformers=__import__("transformers").__version__, quick=args.quick),
          flush=True)
    payload = {"device": device, "torch": torch.__version__, "flash_attn": flash_attn_status()[1], "quick": args.quick}
    log = common.RowLog(args.json, started, lambda: payload, row_line)
    begin = time.perf_counter()
    with HeldWarnings() as warned:
        run_checks(args, log, begin)
    rows = [Row(**r) for r in log.rows]
    print_rows(rows)
    if warned.lines:
        print(f"warnings while checking ({len(warned.lines)}, each once):")
        for line in warned.lines:
            print(f"  {line}")
    failed = [r for r in rows if r.result == "FAIL"]
    counts = {k: sum(r.result == k for r in rows) for k in ("PASS", "FAIL", "SKIP", "INFO")}
    print(" ".join(f"{k} {v}" for k, v in counts.items()) + (" -> FAILED" if failed else " -> OK"))
    return 1 if failed else 0


def run_checks(args: argparse.Namespace, log: common.RowLog, begin: float) -> None:
    """Every check's row into `log` as it finishes, until the deadline; a crash outside every guarded check is one
    FAIL row, the rows before it kept."""
    try:
        for row in checks(args.quick):
            log.add(asdict(row))
            elapsed = time.perf_counter() - begin
            if args.deadline is not None and elapsed > args.deadline:
                log.add(asdict(Row("deadline", f"{args.deadline:.0f} s", "SKIP",
                                   f"{elapsed:.0f} s passed after '{row.check}' [{row.setting}]: the later checks "
                                   "did not run")))
                break
    except Exception as error:  # noqa: BLE001 - outside every guarded check: one FAIL row, the rows before kept
        log.add(asdict(Row("gpu_check", "the run", "FAIL", common.first_line(error, 240))))


if __name__ == "__main__":
    sys.exit(main())
