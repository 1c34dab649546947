"""The engine's invariants on the device `pytest --device` names (default cpu), per attention kernel and dtype: what
`make gpu-check` runs (keydiff.bench.gpu_check; settings in docs/gpu.md). Logits are compared relative to max
|reference logit|; each test records one `detail` line (record_property), which gpu_check's JSON keeps."""

from __future__ import annotations

import random
from collections import namedtuple
from contextlib import nullcontext
from dataclasses import dataclass

import pytest
import torch

import keydiff
from keydiff import available_policies, generate, prefill
from keydiff.decode.static import stand_in_graphs
from keydiff.bench import common
from keydiff.config import STATISTICS_MODES

pytestmark = [pytest.mark.integration, pytest.mark.device, pytest.mark.extended]

TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 5e-2}
ABSOLUTE_FP32 = 1e-5  # fp32 (CPU): also max |diff| in logits, not only relative
# Fast vs materialized kept-set agreement required in bf16: random weights give near-uniform attention, so bf16
# rounding flips near-ties (correct code agrees 0.85-1.0, a statistic over the wrong query rows 0.1-0.5).
AGREEMENT_THRESHOLD = 0.75
STACKED_AGREEMENT = 0.99
EVICTING = [name for name in available_policies() if name != "full"]
GREEDY_POLICIES = ("keydiff", "sink", "knorm", "recent", "random", "tova", "snapkv", "h2o", "full")
AGREEMENT_POLICIES = ("h2o", "tova", "snapkv")
STACKED_POLICIES = ("keydiff", "keydiff_pairwise", "sink", "knorm", "recent", "tova", "snapkv", "h2o")
BATCH_POLICIES = ("keydiff", "tova", "snapkv", "full")
STATISTIC_FIXED = ("tova", "snapkv", "h2o")  # in fixed shapes as one sequence alone (never pooled into a block)
FULL_CHECK_BLOCK = 64
FULL_CHECK_BLOCKS = (1, 5, 64, 128, None)  # None: the whole prompt as one block; B = 1 on prompts <= 512 only
NEEDLE_SEED = 36
NO_FLASH = "flash-attn is not installed (pip install -e '.[flash]' --no-build-isolation)"

# prompt tokens L, N (> 32: SnapKV's window), B, tokens decoded
Sizes = namedtuple("Sizes", "length budget block new_tokens")
# the batch-invariance checks': `batch` prompts of `lengths` tokens (the needle: `length`), KeyDiff N = `budget`
Shape = namedtuple("Shape", "model batch tokens lengths budget length")
Engine = namedtuple("Engine", "model prompt sizes tol")


@dataclass(frozen=True)
class Setting:
    model: str
    attn: str
    dtype: torch.dtype

    def __str__(self) -> str:
        return f"{self.model.removeprefix('random-')}-{self.attn}-{short(self.dtype)}"


# On CUDA, then on any other device (a CPU: every size shrunk, the tiny model only).
SIZES = {"cuda": {"random-tiny": Sizes(300, 64, 32, 12), "random-mid": Sizes(1024, 256, 64, 16)},
         "other": {"random-tiny": Sizes(160, 48, 32, 6)}}
SHAPES = {"cuda": Shape("random-llama-3.2-3b", 16, 32, (1536, 3072), 512, 2048),
          "other": Shape("random-tiny", 16, 5, (96, 160), 48, 128)}
# Eager computes both attention statistics from the same weights: they are compared where they can differ.
ONLY = {"test_fast_statistics_keep_nearly_what_materialized_ones_keep": lambda setting: setting.attn != "eager"}


def kind(device: torch.device) -> str:
    return "cuda" if device.type == "cuda" else "other"


def short(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype]


def settings(device: torch.device) -> list[Setting]:
    if device.type == "cuda":
        return [Setting(model, attn, torch.bfloat16) for model in SIZES["cuda"]
                for attn in ("sdpa", "eager", "flash_attention_2")]
    return [Setting("random-tiny", attn, dtype) for dtype in (torch.float32, torch.bfloat16) for attn in ("sdpa", "eager")]


def pytest_generate_tests(metafunc):
    """`setting` per the device's settings (those ONLY keeps for the test), one model per setting."""
    if "setting" in metafunc.fixturenames:
        keep = ONLY.get(metafunc.function.__name__, lambda setting: True)
        chosen = [s for s in settings(torch.device(metafunc.config.getoption("--device"))) if keep(s)]
        metafunc.parametrize("setting", chosen, ids=[str(s) for s in chosen], scope="module")


@pytest.fixture(scope="module")
def engine(setting, device) -> Engine:
    """The setting's random model on the device, with a random prompt of the device's sizes."""
    if setting.attn == "flash_attention_2":
        pytest.importorskip("flash_attn", reason=NO_FLASH)
    model = common.build_model(setting.model, setting.dtype, setting.attn, device)
    sizes = SIZES[kind(device)][setting.model]
    yield Engine(model, common.random_prompt(model, sizes.length).to(device), sizes, TOLERANCE[setting.dtype])
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()


def relative_error(logits: torch.Tensor, reference: torch.Tensor) -> float:
    return ((logits.float() - reference.float()).abs().max() / reference.float().abs().max().clamp_min(1e-6)).item()


def within(errors: dict[str, float], tol: float) -> tuple[bool, str]:
    worst = max(errors, key=errors.get)
    return all(e <= tol for e in errors.values()), f"rel. max |diff| {errors[worst]:.1e} (worst: {worst}), tol {tol:.0e}"


def kept_agreement(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """Share of kept entries (per layer and KV head, compared as position sets) present in both runs."""
    shared = [(x[..., :, None] == y[..., None, :]).any(-1).float().mean() for x, y in zip(a, b)]
    return torch.stack(shared).mean().item()


def all_equal(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


def exact_in_fp32(setting: Setting, logits: torch.Tensor, reference: torch.Tensor) -> bool:
    return setting.dtype != torch.float32 or (logits.float() - reference.float()).abs().max().item() <= ABSOLUTE_FP32


def test_full_block_prefill_equals_one_forward(engine, setting, record_property):
    """`full` at every block size B equals one forward pass, peaks at L, and leaves the model's kernel as it was."""
    model, prompt = engine.model, engine.prompt
    length = prompt.shape[1]
    with torch.inference_mode():
        reference = model(prompt).logits[:, -1].float()
    errors = {}
    for block in (b for b in FULL_CHECK_BLOCKS if b != 1 or length <= 512):
        state = prefill(model, prompt, "full", None, block)
        errors[f"B={block}"] = relative_error(state.logits, reference)
        assert exact_in_fp32(setting, state.logits, reference), f"B={block}: max |diff| > {ABSOLUTE_FP32}"
        assert state.max_cache_entries == length, f"B={block}: peak {state.max_cache_entries} != L"
        assert model.config._attn_implementation == setting.attn, f"B={block}: the attention kernel was not restored"
    ok, detail = within(errors, engine.tol)
    record_property("detail", f"L={length}: {detail}")
    assert ok, detail


def test_every_policy_holds_n_after_each_block_and_n_plus_b_at_its_peak(engine, record_property):
    model, prompt, sizes = engine.model, engine.prompt, engine.sizes
    budget, block = sizes.budget, sizes.block
    failures, peaks = [], []
    for name in EVICTING:
        after = []
        state = prefill(model, prompt, name, budget, block,
                        on_block=lambda cache: after.append(max(layer.num_entries for layer in cache.layers)))
        peaks.append(max(state.max_cache_entries, generate(model, state, sizes.new_tokens).max_cache_entries))
        if peaks[-1] > budget + block or max(after) > budget:
            failures.append(f"{name} (peak {peaks[-1]}, after-block max {max(after)})")
    record_property("detail", f"{len(EVICTING)} policies, N={budget} B={block}: peak {max(peaks)} <= N+B={budget + block}")
    assert not failures, "; ".join(failures)


def test_a_budget_covering_the_prompt_equals_full(engine, setting, record_property):
    model, prompt, sizes = engine.model, engine.prompt, engine.sizes
    length = prompt.shape[1]
    full = prefill(model, prompt, "full", None, sizes.block).logits
    errors, short_kept = {}, []
    for name in EVICTING:
        state = prefill(model, prompt, name, length, sizes.block)
        errors[name] = relative_error(state.logits, full)
        assert exact_in_fp32(setting, state.logits, full), f"{name}: max |diff| > {ABSOLUTE_FP32}"
        if any(p.shape[-1] != length for p in state.kept_positions):
            short_kept.append(name)
    ok, detail = within(errors, engine.tol)
    record_property("detail", detail)
    assert not short_kept, f"evicted with N = L: {', '.join(short_kept)}"
    assert ok, detail


@torch.inference_mode()
def plain_greedy_loop(model, state, new_tokens: int, position_ids: bool = False) -> list[int]:
    """What a user writes without keydiff.generate: feed the argmax back (with its position_ids, or none)."""
    token, tokens = state.logits.argmax(-1), []
    with keydiff.keydiff_attention(model, state.cache):
        for step in range(new_tokens):
            tokens.append(int(token[0]))
            if step == new_tokens - 1:
                break
            positions = {"position_ids": torch.tensor([[state.prompt_length + step]], device=token.device)} \
                if position_ids else {}
            output = model(input_ids=token[:, None], cache=state.cache, use_cache=True, **positions)
            token = output.logits[:, -1].argmax(-1)
    return tokens


def test_a_plain_loop_over_the_cache_equals_generate(engine, record_property):
    """Every policy kind, with and without position_ids; between calls a layer holds N + 1 until evict() settles it."""
    model, prompt, sizes = engine.model, engine.prompt, engine.sizes
    mismatched = []
    for name in GREEDY_POLICIES:
        budget = None if name == "full" else sizes.budget
        expected = generate(model, prefill(model, prompt, name, budget, sizes.block), sizes.new_tokens)
        for position_ids in (False, True):
            state = prefill(model, prompt, name, budget, sizes.block)
            got = plain_greedy_loop(model, state, sizes.new_tokens, position_ids)
            held = [max(layer.num_entries for layer in state.cache.layers)]
            state.cache.evict()
            held.append(max(layer.num_entries for layer in state.cache.layers))
            full = prompt.shape[1] + sizes.new_tokens - 1
            if got != expected.token_ids[0] or held != ([full] * 2 if budget is None else [budget + 1, budget]):
                mismatched.append(f"{name}{' (position_ids)' if position_ids else ''} held {held}")
    record_property("detail", f"{', '.join(GREEDY_POLICIES)}: {sizes.new_tokens} greedy tokens")
    assert not mismatched, f"differ: {', '.join(mismatched)}"


def kept_state(cache) -> list[dict[str, torch.Tensor]]:
    """Per layer, the policy state of its entries (H2O's sums, KeyDiff's inverse norms) in position order."""
    out = []
    for layer in cache.layers:
        order = layer.positions[..., : layer.num_entries].argsort(-1)
        out.append({name: s[..., : layer.num_entries].gather(-1, order) for name, s in layer.state.items()})
    return out


def test_stacked_eviction_keeps_what_layer_by_layer_keeps(engine, setting, record_property):
    """fp32: bit for bit (kept positions, entries' policy state, logits, tokens); bf16: nearly the same kept sets."""
    model, prompt, sizes = engine.model, engine.prompt, engine.sizes
    rates, tokens_differ, inexact = {}, [], []
    for name in STACKED_POLICIES:
        policy = keydiff.build_policy(name)
        states = [prefill(model, prompt, p, sizes.budget, sizes.block) for p in (policy, keydiff.layer_by_layer(policy))]
        assert states[0].cache.stack is not None and states[1].cache.stack is None, f"{name}: stacked, layer by layer"
        rates[name] = kept_agreement(states[0].kept_positions, states[1].kept_positions)
        prefilled = [(s.logits, [p.clone() for p in s.kept_positions]) for s in states]
        if generate(model, states[0], sizes.new_tokens).token_ids != generate(model, states[1], sizes.new_tokens).token_ids:
            tokens_differ.append(name)
        if setting.dtype == torch.float32 and not (
                torch.equal(prefilled[0][0], prefilled[1][0]) and all_equal(prefilled[0][1], prefilled[1][1])
                and all_equal(*(s.cache.kept_positions() for s in states))
                and all(a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
                        for a, b in zip(*(kept_state(s.cache) for s in states)))):
            inexact.append(name)
    detail = ", ".join(f"{k} {v:.3f}" for k, v in rates.items()) + f" kept-set agreement (>= {STACKED_AGREEMENT})"
    record_property("detail", detail + (f"; tokens differ: {', '.join(tokens_differ)}" if tokens_differ else ""))
    assert min(rates.values()) >= STACKED_AGREEMENT, detail
    # Identical tokens are required only where the kept sets are identical: one differing entry may flip a token.
    assert [name for name in tokens_differ if rates[name] == 1.0] == [], detail
    assert not inexact and (setting.dtype != torch.float32 or not tokens_differ), f"fp32, not bit for bit: {inexact}"


def test_a_batch_of_4_decodes_what_each_decodes_alone(engine, record_property):
    """Four prompts of different lengths (one shorter than N) per policy, greedy."""
    model, prompt, sizes = engine.model, engine.prompt, engine.sizes
    lengths = [prompt.shape[1], prompt.shape[1] * 3 // 4, prompt.shape[1] // 2, max(8, sizes.budget // 2)]
    failures = []
    for name in BATCH_POLICIES:
        states = [prefill(model, prompt[:, :n], name, sizes.budget, sizes.block) for n in lengths]
        alone = [generate(model, state.fork(1)[0], sizes.new_tokens) for state in states]
        requests = [keydiff.Request(state, max_new_tokens=sizes.new_tokens, key=i) for i, state in enumerate(states)]
        batched = dict(keydiff.generate_batch(model, requests, batch_size=len(requests)))
        failures += [f"{name} L={lengths[i]}" for i, single in enumerate(alone) if batched[i].token_ids != single.token_ids]
    total = len(BATCH_POLICIES) * len(lengths)
    record_property("detail", f"{', '.join(BATCH_POLICIES)} x L={lengths}: {total - len(failures)}/{total} "
                              "sequences identical at batch 4")
    assert not failures, f"differ: {', '.join(failures)}"


def test_the_fixed_shape_step_equals_the_ordinary_step(engine, record_property):
    """Bit for bit (on CUDA a replayed graph): KeyDiff 4 forks together and one alone, the statistic ones alone."""
    model, prompt, sizes = engine.model, engine.prompt, engine.sizes
    on, off = (prefill(model, prompt, "keydiff", sizes.budget, sizes.block, fixed_shapes=f) for f in (True, False))
    assert all_equal(on.kept_positions, off.kept_positions), "keydiff prefill: kept differ"
    assert torch.equal(on.logits, off.logits), "keydiff prefill: logits differ"
    tokens = {}
    for fixed in (True, False):
        forks = prefill(model, prompt, "keydiff", sizes.budget, sizes.block).fork(4)
        requests = [keydiff.Request(f, max_new_tokens=sizes.new_tokens, key=i) for i, f in enumerate(forks)]
        batched = dict(keydiff.generate_batch(model, requests, batch_size=4, fixed_shapes=fixed))
        alone = generate(model, prefill(model, prompt, "keydiff", sizes.budget, sizes.block), sizes.new_tokens,
                         fixed_shapes=fixed)
        tokens[fixed] = [batched[i].token_ids for i in range(4)] + [alone.token_ids]
    same = sum(a == b for a, b in zip(tokens[True], tokens[False]))
    differ = []
    for name in STATISTIC_FIXED:
        on, off = (prefill(model, prompt, name, sizes.budget, sizes.block, fixed_shapes=f) for f in (True, False))
        if not (all_equal(on.kept_positions, off.kept_positions) and torch.equal(on.logits, off.logits)
                and generate(model, on, sizes.new_tokens, fixed_shapes=True).token_ids
                == generate(model, off, sizes.new_tokens, fixed_shapes=False).token_ids):
            differ.append(name)
    record_property("detail", f"keydiff: prefill kept and logits =, decode {same}/5 sequences identical (4 forks "
                              f"together, 1 alone); {', '.join(STATISTIC_FIXED)} (prefill, 1 alone): "
                              + (f"differ: {', '.join(differ)}" if differ else "identical"))
    assert same == 5, f"keydiff decode: {same}/5 sequences identical"
    assert not differ, f"differ: {', '.join(differ)}"


def test_one_decoder_captures_one_graph_per_step_across_its_calls(engine, device, record_property):
    """Three prompts through one width-1 Decoder replay one decode and one block graph (stood in for off CUDA)."""
    model, prompt, sizes = engine.model, engine.prompt, engine.sizes
    decode_graphs, block_graphs, same = [], [], 0
    with nullcontext() if device.type == "cuda" else stand_in_graphs():
        decoder = keydiff.Decoder(model, 1)
        for i in range(3):
            ids = prompt[:, : prompt.shape[1] - 5 * i]  # every one >= N + B: each fills its own N + B slots
            reference = prefill(model, ids, "keydiff", sizes.budget, sizes.block, fixed_shapes=False)
            want = (reference.logits, generate(model, reference, sizes.new_tokens, fixed_shapes=False).token_ids)
            state = prefill(model, ids, "keydiff", sizes.budget, sizes.block, decoder=decoder)
            got = (state.logits, generate(model, state, sizes.new_tokens, decoder=decoder).token_ids)
            same += torch.equal(got[0], want[0]) and got[1] == want[1]
            for step in decoder.runner.fixed_steps():
                graphs = decode_graphs if step.q == 1 else block_graphs
                if step.graph is not None and all(step.graph is not known for known in graphs):  # a freed id recurs
                    graphs.append(step.graph)
    detail = (f"3 prompts, one call each: {len(decode_graphs)} decode and {len(block_graphs)} prefill-block graph(s) "
              f"captured, {same}/3 identical to the ordinary step"
              + ("" if device.type == "cuda" else " (CUDA graphs stood in for)")
              + (f"; captures failed: {decoder.stats.reasons}" if decoder.stats.failed else ""))
    record_property("detail", detail)
    assert same == 3 and len(decode_graphs) == 1 and len(block_graphs) == 1, detail


def test_fast_statistics_keep_nearly_what_materialized_ones_keep(engine, setting, record_property):
    model, prompt, sizes = engine.model, engine.prompt, engine.sizes
    rates, differ, threshold = {}, [], AGREEMENT_THRESHOLD if setting.dtype == torch.bfloat16 else 1.0
    for name in AGREEMENT_POLICIES:
        states = [prefill(model, prompt, name, sizes.budget, sizes.block, attention_statistics=mode)
                  for mode in STATISTICS_MODES]
        rates[name] = kept_agreement(*(s.kept_positions for s in states))
        if threshold == 1.0 and not (all_equal(*(s.kept_positions for s in states))
                                     and exact_in_fp32(setting, states[0].logits, states[1].logits)):
            differ.append(name)  # fp32: the same entries, in the same order, and the same logits
    detail = ", ".join(f"{k} {v:.3f}" for k, v in rates.items()) + f" (threshold {threshold})"
    record_property("detail", detail)
    assert min(rates.values()) >= threshold and not differ, detail + f"; differ: {differ}"


@pytest.mark.parametrize("model_name", ["random-tiny", "random-mid"])
def test_flash_attention_2_gives_sdpas_logits(device, model_name, record_property):
    if device.type != "cuda":
        pytest.skip("flash_attention_2 runs on CUDA only")
    pytest.importorskip("flash_attn", reason=NO_FLASH)
    sizes = SIZES["cuda"][model_name]
    sdpa = common.build_model(model_name, torch.bfloat16, "sdpa", device)
    flash = common.build_model(model_name, torch.bfloat16, "flash_attention_2", device)
    flash.load_state_dict(sdpa.state_dict())
    prompt = common.random_prompt(sdpa, sizes.length).to(device)
    errors, diffs = {}, []
    for name in ("full", "keydiff", "snapkv"):
        budget = None if name == "full" else sizes.budget
        a, b = (prefill(m, prompt, name, budget, sizes.block).logits for m in (sdpa, flash))
        errors[name] = relative_error(b, a)
        diffs.append((b - a).abs().max().item())
    ok, detail = within(errors, TOLERANCE[torch.bfloat16])
    record_property("detail", f"max |diff| {max(diffs):.3g}; {detail}")
    assert ok, detail


def split_over(model, devices: list[torch.device]):
    """The decoder layers in contiguous halves over `devices`, as accelerate's device_map=auto places them."""
    from accelerate import dispatch_model

    layers = model.config.num_hidden_layers
    device_map = {"model.embed_tokens": devices[0], "model.rotary_emb": devices[0], "model.norm": devices[-1],
                  "lm_head": devices[-1]}
    for i in range(layers):
        device_map[f"model.layers.{i}"] = devices[i * len(devices) // layers]
    return dispatch_model(model, device_map=device_map)


def test_a_model_split_over_two_devices_is_exact_with_a_stack_per_device(device, record_property):
    """CUDA: the mid-size model in bf16 over two GPUs; elsewhere the tiny one in fp32 over the device twice."""
    if device.type == "cuda":
        if torch.cuda.device_count() < 2:
            pytest.skip(f"needs 2+ GPUs: {torch.cuda.device_count()} visible")
        devices, model_name, dtype = [torch.device("cuda:0"), torch.device("cuda:1")], "random-mid", torch.bfloat16
    else:
        devices, model_name, dtype = [device, device], "random-tiny", torch.float32
    sizes = SIZES[kind(device)][model_name]
    model = split_over(common.build_model(model_name, dtype, "sdpa", "cpu"), devices)
    prompt = common.random_prompt(model, sizes.length).to(devices[0])
    with torch.inference_mode():
        reference = model(prompt).logits[:, -1].float()
    error = relative_error(prefill(model, prompt, "full", None, FULL_CHECK_BLOCK).logits.cpu(), reference.cpu())
    assert error <= TOLERANCE[dtype], f"full vs forward {error:.1e}"
    state = prefill(model, prompt, "keydiff", sizes.budget, sizes.block)
    cache = state.cache
    for i, layer in enumerate(cache.layers):
        assert layer.keys.device == next(model.model.layers[i].parameters()).device, f"layer {i}'s cache"
    stacks = sorted((str(s.keys.device), s.count) for s in cache.storages)
    assert len(stacks) == len(set(devices)), f"storages {stacks}: expected one stack per device"
    expected_tokens = generate(model, state, sizes.new_tokens).token_ids[0]
    assert cache.max_entries <= sizes.budget + sizes.block, f"peak {cache.max_entries} > N+B"
    tokens = plain_greedy_loop(model, prefill(model, prompt, "keydiff", sizes.budget, sizes.block), sizes.new_tokens)
    assert tokens == expected_tokens, "plain loop tokens differ from generate's"
    record_property("detail", f"{model_name} {short(dtype)} over {', '.join(map(str, devices))}: full vs forward "
                              f"{error:.1e}; stacks {stacks}; peak {cache.max_entries} <= N+B; loop = generate")


@pytest.mark.parametrize("dtype, batch_invariant", [(torch.float32, False), (torch.bfloat16, False),
                                                    (torch.bfloat16, True)], ids=["fp32", "bf16", "bf16-batch_invariant"])
def test_a_batch_of_16_decodes_what_each_decodes_alone(device, dtype, batch_invariant, record_property, monkeypatch):
    """fp32 (TF32 off) and bf16 with `batch_invariant` all identical; bf16 without it a count, recorded."""
    shape = SHAPES[kind(device)]
    if device.type == "cuda":
        monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    model = common.build_model(shape.model, dtype, "sdpa", device)
    low, high = shape.lengths
    lengths = torch.linspace(low, high, shape.batch).round().long().tolist()
    prompts = [common.random_prompt(model, n, seed=i).to(device) for i, n in enumerate(lengths)]
    counts = {}
    for name, budget in (("keydiff", shape.budget), ("full", None)):
        alone = [generate(model, prefill(model, p, name, budget, 128), shape.tokens,
                          batch_invariant=batch_invariant).token_ids for p in prompts]
        requests = [keydiff.Request(prefill(model, p, name, budget, 128), max_new_tokens=shape.tokens, key=i)
                    for i, p in enumerate(prompts)]
        together = dict(keydiff.generate_batch(model, requests, shape.batch, batch_invariant=batch_invariant))
        assert sorted(together) == list(range(shape.batch))
        assert all(len(together[i].token_ids[0]) == shape.tokens for i in range(shape.batch))
        counts[name] = sum(together[i].token_ids == alone[i] for i in range(shape.batch))
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    detail = (f"{shape.model} {short(dtype)}: {shape.batch} prompts of {low}-{high} tokens, {shape.tokens} tokens: "
              + ", ".join(f"{name} {same}/{shape.batch} identical" for name, same in counts.items()))
    record_property("detail", detail)
    record_property("identical", counts)
    if dtype == torch.float32 or batch_invariant:
        assert all(same == shape.batch for same in counts.values()), detail


def needle_outputs(model, needle, others: list, position: int, shape: Shape, batch_invariant: bool):
    """The needle's [greedy, sampled] tokens alone and at `position` among `others`, each from a fork."""
    def requests(states: list, sample: bool) -> list:
        return [keydiff.Request(s.fork(1)[0], max_new_tokens=shape.tokens, key=i, do_sample=sample,
                                seed=NEEDLE_SEED if sample else None) for i, s in enumerate(states)]

    batch = others[:position] + [needle] + others[position:]
    alone, together = [], []
    for sample in (False, True):
        (_, single), = keydiff.generate_batch(model, requests([needle], sample), 1, batch_invariant=batch_invariant)
        alone.append(single.token_ids)
        out = dict(keydiff.generate_batch(model, requests(batch, sample), len(batch), batch_invariant=batch_invariant))
        together.append(out[position].token_ids)
    return alone, together


def test_a_needle_decodes_alone_what_it_decodes_in_a_batch(device, record_property):
    """vLLM's check, batch_invariant=True: identical; the mode off is the recorded negative control."""
    from keydiff.bench.gpu_check import environment

    shape = SHAPES[kind(device)]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = common.build_model(shape.model, dtype, "sdpa", device)
    low, high = shape.lengths
    lengths = torch.linspace(low, high, shape.batch - 1).round().long().tolist()

    def prefilled(length: int, seed: int):
        return prefill(model, common.random_prompt(model, length, seed=seed).to(device), "keydiff", shape.budget, 128)

    others = [prefilled(n, i) for i, n in enumerate(lengths)]
    needle = prefilled(shape.length, 1000)
    position = random.Random(NEEDLE_SEED).randrange(shape.batch)
    same = {}
    for invariant in (True, False):
        alone, together = needle_outputs(model, needle, others, position, shape, invariant)
        same[invariant] = [a == t for a, t in zip(alone, together)]
    what = (f"a needle of {shape.length} tokens alone and at position {position} of {shape.batch} (seed "
            f"{NEEDLE_SEED}), {shape.tokens} tokens greedy and sampled")
    control = ("differ: the check can fail and means something" if not all(same[False])
               else "identical: on this machine the check proves nothing")
    record_property("detail", f"{what}: batch_invariant {same[True]}; mode off (control) {control}")
    # what a batch-invariance result depends on: the GPU, its driver, CUDA, torch and Triton (None on a CPU)
    found = environment(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    for key, value in {**{k: found[k] for k in ("gpu", "driver", "cuda", "torch", "triton")}, "seed": NEEDLE_SEED,
                       "position": position, "identical": same[True], "identical_mode_off": same[False],
                       "proves_nothing": all(same[False])}.items():
        record_property(key, value)
    assert all(same[True]), f"{what}: differ with batch_invariant (greedy, sampled: {same[True]})"
