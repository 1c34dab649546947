"""kvpress's query-agnostic protocol (`query_aware=false`): the engine's held suffix, the tasks' context/question
splits (RULER checked against kvpress's own split rule and pipeline), and the runner's bookkeeping."""

from __future__ import annotations

import pytest
import torch

from keydiff import available_policies, build_policy, generate, prefill
from tests.conftest import tiny_llama

EVICTING = [name for name in available_policies() if name != "full"]
# Head-adaptive, layer-scheduled and chunked variants (conf/policy presets) on top of the built-in names.
VARIANTS = {
    "adakv_snapkv": ("snapkv", {"head_budgets": "adakv", "alpha_safeguard": 0.2}),
    "adakv_keydiff": ("keydiff", {"head_budgets": "adakv", "alpha_safeguard": 0.2}),
    "snapkv_pyramid": ("snapkv", {"layer_budgets": {"schedule": "pyramid", "beta": 20, "window": 32}}),
    "chunkkv": ("snapkv", {"window": 32, "kernel_size": 7, "pooling": "avg", "chunk_length": 20, "chunk_scope": "layer"}),
}
POLICIES = EVICTING + list(VARIANTS)
SUFFIX = 37  # longer than the block below, so the suffix is not one more block in disguise


def make_policy(name: str):
    target, params = VARIANTS.get(name, (name, {}))
    return build_policy(target, **params)


def held(positions: torch.Tensor) -> list[set[int]]:
    """Per KV head of batch row 0, the set of positions held (padding -1 left out)."""
    return [set(int(p) for p in head if p >= 0) for head in positions[0]]


@pytest.mark.parametrize("name", POLICIES)
def test_question_is_whole_at_the_first_generated_token(model, prompt, name):
    """Every token of the held suffix is in every layer and head at the first generated token, and the context
    was compressed exactly as without a suffix (the suffix evicts nothing of it)."""
    length, budget, block = prompt.shape[1], 64, 32
    context = length - SUFFIX
    state = prefill(model, prompt, make_policy(name), budget, block, held_suffix=SUFFIX)
    alone = prefill(model, prompt[:, :context], make_policy(name), budget, block)
    question = set(range(context, length))
    assert state.held_suffix == SUFFIX
    for layer, (positions, reference) in enumerate(zip(state.kept_positions, alone.kept_positions)):
        for head, (kept, ref) in enumerate(zip(held(positions), held(reference))):
            assert question <= kept, (name, layer, head)
            if name != "random":  # random draws differ between the two runs
                assert kept - question == ref, (name, layer, head)
    # Nothing was dropped after the suffix: the cache holds (context kept) + S per head.
    assert all(layer.num_entries == min(n, context) + SUFFIX for layer, n in zip(state.cache.layers, state.cache.layer_budgets))


@pytest.mark.parametrize("name", ["keydiff", "snapkv", "tova", "h2o", "kvzip"])
def test_budget_covering_the_context_equals_the_full_forward(model, prompt, name):
    """N >= context: nothing is evicted, so the logits are the model's on the whole prompt."""
    state = prefill(model, prompt, make_policy(name), prompt.shape[1] - SUFFIX, 32, held_suffix=SUFFIX)
    with torch.no_grad():
        reference = model(prompt).logits[:, -1].float()
    assert torch.allclose(state.logits, reference, atol=1e-5)


@pytest.mark.parametrize("name", ["keydiff", "snapkv", "adakv_snapkv", "kvzip"])
def test_held_suffix_goes_at_the_first_decoding_step_or_never(model, prompt, name):
    """evict=True: the first decoding step's eviction brings every layer back to N (its statistic is that
    step's); evict=False: the suffix and every generated token stay (kvpress's pipeline)."""
    budget, steps = 64, 5
    state = prefill(model, prompt, make_policy(name), budget, 32, held_suffix=SUFFIX)
    out = generate(model, state, steps, record_steps=True)
    assert out.step_entries and max(out.step_entries) <= budget
    assert out.max_cache_entries == budget + SUFFIX + 1  # the first step's token is written before the eviction
    state = prefill(model, prompt, make_policy(name), budget, 32, held_suffix=SUFFIX)
    out = generate(model, state, steps, evict=False, record_steps=True)
    assert out.step_entries == [budget + SUFFIX + i for i in range(1, steps)]


def test_held_suffix_equals_the_same_passes_run_by_hand(model, prompt):
    """The held suffix is one plain pass against the compressed cache: the same logits as feeding it by hand
    after prefilling the context, with the cache's eviction after it left out."""
    context = prompt.shape[1] - SUFFIX
    state = prefill(model, prompt, "keydiff", 64, 32, held_suffix=SUFFIX)
    by_hand = prefill(model, prompt[:, :context], "keydiff", 64, 32)
    with torch.no_grad():
        from keydiff.attention import keydiff_attention

        with keydiff_attention(model, by_hand.cache):
            logits = model(input_ids=prompt[:, context:], past_key_values=by_hand.cache, use_cache=True).logits
    assert torch.allclose(state.logits, logits[:, -1].float(), atol=1e-5)


def test_held_suffix_must_leave_a_context(model, prompt):
    with pytest.raises(ValueError, match="held_suffix"):
        prefill(model, prompt, "keydiff", 64, 32, held_suffix=prompt.shape[1])
    with pytest.raises(ValueError, match="held_suffix"):
        prefill(model, prompt, "keydiff", 64, 32, held_suffix=-1)


def test_sdpa_and_eager_agree_with_a_held_suffix(prompt):
    """The masks transformers builds count the held entries (not N): stock attention gives the same logits."""
    results = []
    for attn in ("eager", "sdpa"):
        model = tiny_llama(attn)
        state = prefill(model, prompt, "keydiff", 64, 32, held_suffix=SUFFIX)
        out = generate(model, state, 4, evict=False)
        results.append((state.logits, out.token_ids))
    assert torch.allclose(results[0][0], results[1][0], atol=1e-4)
    assert results[0][1] == results[1][1]
