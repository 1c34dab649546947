"""Head-adaptive eviction over whole pools (AdaKV's `drop_segments` over a SegmentStack): the pooled selection against
`adakv_keep`, all layers in one call keeping what layer-by-layer eviction keeps, KeyDiff's pool scores."""

from __future__ import annotations

import pytest
import torch

from keydiff import build_policy, generate, prefill
from keydiff.cache import adaptive
from keydiff.policies.adakv import FORCED, adakv_drop_segments, adakv_keep
from keydiff.policies.base import LayerView, SegmentView, score_then_position
from keydiff.testing import variant
from tests.conftest import tiny_llama

pytestmark = pytest.mark.unit

BUDGET, BLOCK, LENGTH = 48, 16, 150


def pool_of(counts: list[list[int]], gap: int, generator: torch.Generator, dim: int = 4) -> SegmentView:
    """Rows of pools whose heads' segments lie one after another (in head order) with `gap` free slots after each."""
    heads = len(counts[0])
    size = max(sum(row) + heads * gap for row in counts)
    slots = torch.arange(size)
    starts = []
    for row in counts:
        start, first = 0, []
        for count in row:
            first.append(start)
            start += count + gap
        starts.append(first)
    starts, counts_t = torch.tensor(starts), torch.tensor(counts)
    member = (slots >= starts[..., None]) & (slots < (starts + counts_t)[..., None])
    owner = (slots >= starts[:, 1:, None]).sum(dim=1)
    positions = torch.randint(0, 60, (len(counts), size), generator=generator)  # free slots: anything
    for row, (first, row_counts) in enumerate(zip(starts.tolist(), counts)):
        for start, count in zip(first, row_counts):  # unique within a head, as the cache's are
            positions[row, start:start + count] = torch.randperm(60, generator=generator)[:count]
    return SegmentView(keys=torch.randn(len(counts), size, dim, generator=generator), positions=positions, state={},
                    member=member, owner=owner, counts=counts_t)


@pytest.mark.extended
def test_pooled_selection_equals_adakv_keep_with_ties_and_binding_safeguards():
    g = torch.Generator().manual_seed(0)
    for trial in range(60):
        heads, budget = 3, 10
        rows = [torch.randint(3, 30, (heads,), generator=g).tolist() for _ in range(4)]  # at most 60 each
        pool = pool_of(rows, gap=int(torch.randint(0, 3, (1,), generator=g)), generator=g)
        scores = torch.randint(0, 4, pool.positions.shape, generator=g).float()  # many equal scores
        keys = score_then_position(scores, pool.positions)
        alpha = [0.0, 0.2, 0.5, 0.9, 1.0][trial % 5]
        dropped = adakv_drop_segments(keys, pool, budget, alpha)
        for row, counts in enumerate(rows):
            per_head = [pool.member[row, h].nonzero().squeeze(1) for h in range(heads)]
            masks = adakv_keep([keys[row, slots] for slots in per_head], [None] * heads, budget, alpha)
            for slots, keep in zip(per_head, masks):
                assert torch.equal(~dropped[row, slots], keep), (trial, row)
            assert not bool((dropped[row] & ~pool.valid[row]).any())  # free slots are never "dropped"
            assert int((~dropped[row] & pool.valid[row]).sum()) == min(sum(counts), heads * budget)


def test_the_selection_refuses_to_drop_forced_entries():
    """Every entry forced but fewer than the excess droppable: impossible for AdaKV's own choices, refused."""
    g = torch.Generator().manual_seed(1)
    pool = pool_of([[5, 5]], gap=0, generator=g)
    keys = torch.full(pool.positions.shape, FORCED)
    with pytest.raises(RuntimeError, match="fewer droppable entries"):
        adakv_drop_segments(keys, pool, budget=2, alpha=0.0)


def test_keydiff_pool_scores_are_the_per_head_scores():
    """KeyDiff's `score_segments` on a pool equals its `score` on each head alone (up to the order of additions)."""
    g = torch.Generator().manual_seed(2)
    policy = build_policy("keydiff")
    pool = pool_of([[7, 12, 3], [20, 1, 9]], gap=2, generator=g, dim=8)
    pool.state["inv_norm"] = torch.linalg.vector_norm(pool.keys, dim=-1).clamp_min(1e-8).reciprocal()
    scores = policy.score_segments(pool)
    for row in range(2):
        for head in range(3):
            slots = pool.member[row, head].nonzero().squeeze(1)
            view = LayerView(keys=pool.keys[row, slots][None, None], values=pool.keys[row, slots][None, None],
                             positions=pool.positions[row, slots][None, None], attention=None,
                             state={"inv_norm": pool.state["inv_norm"][row, slots][None, None]}, layers=(0,))
            torch.testing.assert_close(scores[row, slots], policy.score(view)[0, 0], rtol=1e-5, atol=1e-6)


def run(model, ids, policy):
    state = prefill(model, ids, policy, BUDGET, BLOCK)
    return state, generate(model, state, 6, eos_token_ids=())


@pytest.mark.integration
@pytest.mark.extended
def test_all_layers_are_evicted_in_one_call_and_keep_what_layer_by_layer_keeps(monkeypatch):
    model = tiny_llama()
    ids = torch.randint(0, 256, (2, LENGTH), generator=torch.Generator().manual_seed(3))
    calls = []

    def counted(self, pool, budget):  # the rows of every pool chosen in one call
        calls.append(pool.keys.shape[0])
        return super(type(self), self).drop_segments(pool, budget)

    def counting():
        return variant(build_policy("keydiff", head_budgets="adakv"), drop_segments=counted)

    together = run(model, ids, counting())
    assert calls and set(calls) == {3 * 2}  # every eviction: the 3 layers' pools (2 rows each) at once
    stack = together[0].cache.layers[0].storage.stack
    assert all(layer.storage.in_stack and layer.storage.stack is stack for layer in together[0].cache.layers)
    assert stack.keys.shape[:2] == (3, 2)  # [layers, batch, P, dim]: one allocation
    # the same run with the stack refused (no layer fits it): each layer's pool evicted on its own
    monkeypatch.setattr(adaptive.SegmentStack, "claim", lambda *args, **kwargs: None)
    calls.clear()
    alone = run(model, ids, counting())
    assert calls and set(calls) == {2}
    for ours, theirs in zip(together[0].cache.kept_positions(), alone[0].cache.kept_positions()):
        assert torch.equal(ours, theirs)
    assert together[1].token_ids == alone[1].token_ids
