"""Head-adaptive budgets (AdaKV) together with CriticalKV, key re-rotation, KVzip and ChunkKV.

The AdaKV form of CriticalKV (kvpress's `CriticalAdaKVPress`) is checked against plain loops at every eviction
of a block-wise prefill; the combinations that are refused fail with one line when the policy is built."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from keydiff.engine import generate, prefill
from keydiff.policies import HeadAdaptive, build_policy
from keydiff.policies.base import LayerView
from keydiff.policies.criticalkv import STATE, output_norms
from tests.test_adakv import brute_force_keep, head_counts, prompt_ids
from tests.conftest import tiny_llama
from tests.test_criticalkv import brute_force_norms

pytestmark = pytest.mark.integration

BUDGET, BLOCK = 48, 16


def brute_force_critical_adakv(raw, protected, positions, norms, budget, alpha, ratio, epsilon) -> list[list[int]]:
    """Kept positions per head of one batch row, by loops: each head's count is AdaKV's choice over the raw
    scores (`brute_force_keep`); within head h of count c: its protected entries, its top max(floor(ratio x c),
    floor(alpha x budget)) raw scores (protected first, ties to the newer position: stage 1 and the safeguard),
    then the best (score - min(0, min score) + epsilon) x norm (ties to the newer) until c."""
    counts = [len(kept) for kept in brute_force_keep(raw, protected, positions, budget, alpha)]
    safe = math.floor(alpha * budget + 1e-9)
    kept = []
    for score, prot, pos, norm, count in zip(raw, protected, positions, norms, counts):
        everything = range(len(pos))
        order = sorted(everything, key=lambda i: (prot[i], score[i], pos[i]), reverse=True)
        first = max(math.floor(ratio * count + 1e-9), safe)
        stage_one = set(order[:first]) | {i for i in everything if prot[i]}
        shift = min(0.0, min(s for s in score if math.isfinite(s)))
        rest = sorted((i for i in everything if i not in stage_one),
                      key=lambda i: ((score[i] - shift + epsilon) * norm[i], pos[i]), reverse=True)
        chosen = list(stage_one) + rest[:count - len(stage_one)]
        kept.append(sorted(pos[i] for i in chosen))
    return kept


@dataclass
class CheckedCriticalAdaptive(HeadAdaptive):
    """HeadAdaptive over Critical that checks every choice against the loops and records what it kept."""

    model: torch.nn.Module | None = None
    choices: list | None = None

    def keep_heads(self, heads, budget):
        masks = super().keep_heads(heads, budget)
        critical, inner = self.scorer, self.scorer.scorer
        weight = self.model.model.layers[heads[0].layers[0]].self_attn.o_proj.weight.detach()
        total_heads = self.model.config.num_attention_heads
        raw, protected, positions, norms = [], [], [], []
        for h, view in enumerate(heads):
            raw.append(inner.score(view)[0, 0].float().tolist())
            protect = inner.protected(view, budget)
            positions.append(view.positions[0, 0].tolist())
            protected.append([False] * len(positions[-1]) if protect is None else protect[0, 0].tolist())
            # ||W_o v||_1 of head h from the model's whole o_proj: the stored state and the one-head view's
            # own projection (its KV group's columns) must both give it.
            expected = brute_force_norms(view.values.expand(1, len(heads), -1, -1), weight, total_heads)[0, h]
            torch.testing.assert_close(view.state[STATE][0, 0].double(), expected, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(output_norms(view.values, view.output_projection)[0, 0].double(), expected,
                                       rtol=1e-5, atol=1e-6)
            norms.append(expected.tolist())
        # epsilon is added to one query's attention (kvpress averages SnapKV's window, ours sums it): x the rows.
        epsilon = float(torch.as_tensor(critical.scaled_epsilon(heads[0])).flatten()[0])
        expected = brute_force_critical_adakv(raw, protected, positions, norms, budget, self.alpha_safeguard,
                                              critical.first_stage_ratio, epsilon)
        actual = [sorted(view.positions[0, 0][mask].tolist()) for view, mask in zip(heads, masks)]
        assert actual == expected
        self.choices.append(actual)
        return masks


@pytest.mark.extended
@pytest.mark.parametrize("name,params,alpha", [("snapkv", {"window": 8}, 0.2), ("keydiff", {}, 0.2),
                                               ("h2o", {"recent_fraction": 0.25}, 0.2), ("snapkv", {"window": 8}, 0.6)])
def test_every_eviction_of_a_blockwise_prefill_is_the_brute_force_choice(model, name, params, alpha):
    """alpha 0.6: a head's safeguard (28 entries) exceeds half its count, so stage 1 alone would not keep it."""
    inner = build_policy(name, critical=True, **params)
    policy = CheckedCriticalAdaptive(inner, alpha_safeguard=alpha, model=model, choices=[])
    layers, compared = model.config.num_hidden_layers, []

    def after_block(cache):
        """After a block that evicted, each layer holds exactly its checked choice."""
        if len(policy.choices) > layers * len(compared):
            chosen = policy.choices[layers * len(compared):]
            assert len(chosen) == layers
            for layer, choice in zip(cache.kept_positions(), chosen):
                assert [[p for p in head if p >= 0] for head in layer[0].tolist()] == choice
            compared.append(True)

    length = 150
    prefill(model, prompt_ids(length=length), policy, BUDGET, BLOCK, on_block=after_block)
    assert len(compared) >= (length - 2 * BUDGET) // BLOCK  # every block past the layer's total evicted


@pytest.mark.extended
def test_a_non_square_output_projection_gives_each_head_its_own_columns():
    """head_dim 8 with hidden 64: o_proj is [64, 32], so a KV head's columns are 32 / kv_heads wide (its group's
    query heads x head_dim), not hidden / kv_heads. Every other test model's o_proj is square."""
    model = tiny_llama(head_dim=8)
    assert tuple(model.model.layers[0].self_attn.o_proj.weight.shape) == (64, 32)
    policy = CheckedCriticalAdaptive(build_policy("snapkv", window=8, critical=True), model=model, choices=[])
    prefill(model, prompt_ids(length=150), policy, BUDGET, BLOCK)
    assert len(policy.choices) >= model.config.num_hidden_layers * ((150 - 2 * BUDGET) // BLOCK)


@pytest.mark.extended
def test_batch_rows_are_chosen_row_by_row_against_the_loops(model):
    """Batch 2 (different prompts): every row's choice, and its entries' ||W_o v||_1 (set from one view of all
    rows and heads), checked against the loops at every eviction of prefill and decoding."""
    policy = CheckedCriticalAdaptive(build_policy("snapkv", window=8, critical=True), model=model, choices=[])
    state = prefill(model, prompt_ids(batch=2), policy, BUDGET, BLOCK)
    prefilled = len(policy.choices)
    generate(model, state, max_new_tokens=3)
    assert prefilled >= 2 * 3 * 4 and len(policy.choices) > prefilled  # both rows, every layer, decoding too
    assert all(sum(row) == 2 * BUDGET for layer in head_counts(state.cache) for row in layer)


@pytest.mark.extended
def test_the_preset_differs_from_both_parents(model):
    """adakv_criticalkv's config builds HeadAdaptive(Critical(SnapKV)); its kept sets differ from plain AdaKV-SnapKV
    (stage 2 matters) and its heads keep different counts (the budgets are shared), all within the total."""
    from tests.test_golden import preset

    name, params = preset("adakv_criticalkv")
    assert (name, params["window"], params["critical"], params["head_budgets"]) == ("snapkv", 32, True, "adakv")
    policy = build_policy(name, **params)
    assert type(policy).__name__ == "HeadAdaptive" and type(policy.scorer).__name__ == "Critical"
    params = {"window": 8, "kernel_size": 7, "pooling": "avg"}
    critical = prefill(model, prompt_ids(), build_policy("snapkv", critical=True, head_budgets="adakv", **params),
                       BUDGET, BLOCK)
    plain = prefill(model, prompt_ids(), build_policy("snapkv", head_budgets="adakv", **params), BUDGET, BLOCK)
    assert any(not torch.equal(a, b) for a, b in zip(critical.cache.kept_positions(), plain.cache.kept_positions()))
    counts = [layer[0] for layer in head_counts(critical.cache)]
    assert all(sum(layer) == 2 * BUDGET for layer in counts)
    assert any(len(set(layer)) > 1 for layer in counts)


@pytest.mark.unit
@pytest.mark.extended
def test_scores_tied_across_heads_follow_the_adakv_tie_rule():
    """Scores from a few values (exact ties within and across heads, at the head-budget boundary too) and norms
    from a few values (ties in stage 2): each head's count is AdaKV's choice (equal scores: the newer position
    first, then the lower head), the same counts plain AdaKV keeps, and the two stages follow the loops.

    This is where kvpress's two presses disagree with each other: at L = 4096 the 3072nd and 3073rd raw scores of
    one layer were equal in float32, and CriticalAdaKVPress gave the count to the lower flattened index while
    AdaKVPress kept the higher (docs/peers.md). Here a tie is decided by one rule in both forms."""
    g = torch.Generator().manual_seed(0)
    heads, budget, dim = 3, 10, 4
    for trial in range(40):
        alpha = [0.0, 0.2, 0.5, 1.0][trial % 4]
        recent = [0.0, 0.2][trial % 2]
        policy = build_policy("h2o", recent_fraction=recent, critical=True, head_budgets="adakv",
                              alpha_safeguard=alpha)
        plain = build_policy("h2o", recent_fraction=recent, head_budgets="adakv", alpha_safeguard=alpha)
        views = []
        for n in torch.randint(budget // 2, 3 * budget, (heads,), generator=g).tolist():
            views.append(LayerView(
                keys=torch.randn(1, 1, n, dim, generator=g), values=torch.randn(1, 1, n, dim, generator=g),
                positions=torch.randperm(4 * budget, generator=g)[:n][None, None], attention=None,
                state={"h2o": torch.randint(0, 4, (1, 1, n), generator=g).float(),
                       STATE: torch.randint(1, 4, (1, 1, n), generator=g).float()}, layers=(0,)))
        masks = policy.keep_heads(views, budget)
        actual = [sorted(view.positions[0, 0][mask].tolist()) for view, mask in zip(views, masks)]
        inner = policy.scorer.scorer
        protected = []
        for view in views:
            protect = inner.protected(view, budget)
            protected.append([False] * view.positions.shape[-1] if protect is None else protect[0, 0].tolist())
        expected = brute_force_critical_adakv(
            [v.state["h2o"][0, 0].tolist() for v in views], protected, [v.positions[0, 0].tolist() for v in views],
            [v.state[STATE][0, 0].tolist() for v in views], budget, alpha, policy.scorer.first_stage_ratio,
            policy.scorer.epsilon)
        assert actual == expected
        assert [int(m.sum()) for m in masks] == [int(m.sum()) for m in plain.keep_heads(views, budget)]
        assert sum(map(len, actual)) == min(heads * budget, sum(v.positions.shape[-1] for v in views))


@pytest.mark.extended
def test_decoding_keeps_the_layer_total(model):
    policy = build_policy("snapkv", window=8, critical=True, head_budgets="adakv")
    state = prefill(model, prompt_ids(), policy, BUDGET, BLOCK)
    out = generate(model, state, max_new_tokens=5)
    assert len(out.token_ids[0]) == 5
    assert all(sum(layer[0]) == 2 * BUDGET for layer in head_counts(state.cache))


# --------------------------------------------------------------------------- combinations
@pytest.mark.unit
@pytest.mark.parametrize("params,message", [
    ({"key_rerotation": True}, "key_rerotation with head_budgets=adakv"),
    ({"key_rerotation": "contiguous"}, "key_rerotation with head_budgets=adakv"),
])
def test_key_rerotation_with_head_budgets_is_refused_in_one_line(params, message):
    with pytest.raises(ValueError, match=message) as error:
        build_policy("keydiff", head_budgets="adakv", **params)
    assert "\n" not in str(error.value)
    build_policy("keydiff", **params)  # each alone is fine
    build_policy("keydiff", head_budgets="adakv")


@pytest.mark.unit
def test_kvzip_with_head_budgets_is_refused_in_one_line():
    with pytest.raises(ValueError, match="kvzip with head_budgets=adakv") as error:
        build_policy("kvzip", head_budgets="adakv")
    assert "\n" not in str(error.value)
    build_policy("kvzip")


@pytest.mark.unit
def test_chunkkv_with_head_budgets_is_refused_in_one_line():
    with pytest.raises(ValueError, match="chunk_length with head_budgets=adakv") as error:
        build_policy("snapkv", chunk_length=20, head_budgets="adakv")
    assert "\n" not in str(error.value)
    build_policy("snapkv", chunk_length=20)


def test_rerotation_composed_by_hand_around_head_budgets_fails_clearly(model):
    """build_policy refuses it; a policy composed in Python reaches the cache, which refuses it at eviction."""
    from keydiff.policies import KeyDiff, Rerotated

    policy = Rerotated(HeadAdaptive(KeyDiff()), mode="absolute")
    with pytest.raises(RuntimeError, match="key re-rotation is not supported with head-adaptive budgets"):
        prefill(model, prompt_ids(), policy, BUDGET, BLOCK)


@pytest.mark.extended
@pytest.mark.parametrize("name,params", [("snapkv", {"window": 8, "critical": True}), ("keydiff", {})])
def test_check_policy_runs_head_adaptive_policies(name, params):
    """keydiff.testing.check_policy counts head-adaptive evictions (keep_heads) and checks the layer bound."""
    from keydiff.testing import check_policy

    summary = check_policy(name, head_budgets="adakv", **params)
    assert summary["evictions"] > 0 and summary["layer_budgets"] == [48, 48, 48]
    # KeyDiff's pools are chosen all layers at once, and that was compared with the head-by-head choice
    assert summary["pools_checked"] == (name == "keydiff")
