"""ChunkKV (keydiff.policies.chunkkv.Chunked) against the brute-force loops of tests/test_policy_contract.py (which
also checks every eviction of a real prefill): scopes, whole chunks, exact float32 sums."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from keydiff.policies import Chunked, KNorm, SnapKV, build_policy
from keydiff.policies.base import LayerView, Policy
from tests.test_policy_contract import choose, scores_and_protected

pytestmark = pytest.mark.unit


def kept_positions(policy, layer, budget) -> list[list[list[int]]]:
    keep = policy.keep_indices(layer, budget)
    return layer.positions.gather(-1, keep).sort(dim=-1).values.tolist()


def random_view(seed: int, batch=2, heads=3, n=97, span=400) -> LayerView:
    """Entries in shuffled buffer order, with gaps in their positions (as after earlier evictions)."""
    g = torch.Generator().manual_seed(seed)
    positions = torch.stack([torch.randperm(span, generator=g)[:n] for _ in range(batch * heads)]).view(batch, heads, n)
    return LayerView(keys=torch.randn(batch, heads, n, 8, generator=g),
                     values=torch.randn(batch, heads, n, 8, generator=g),
                     positions=positions, attention=torch.rand(batch, heads, n, generator=g), state={}, layers=0)


@pytest.mark.parametrize("chunk_length", [1, 3, 20])
@pytest.mark.parametrize("scorer", [KNorm(), SnapKV(window=8)], ids=["knorm", "snapkv"])
@pytest.mark.parametrize("scope", ["layer", "head"])
def test_random_views_keep_what_the_reference_keeps(chunk_length, scorer, scope):
    layer, budget = random_view(chunk_length), 41
    policy = Chunked(scorer, chunk_length=chunk_length, scope=scope)
    scores, protected = scores_and_protected(policy, layer, budget)  # the chunk sums by loops
    expected = [choose(*row, [budget] * len(row[0])) for row in zip(scores, protected, layer.positions.tolist())]
    assert kept_positions(policy, layer, budget) == expected


@dataclass
class GivenScores(Policy):
    """Scores each entry by the view's `attention` (the test sets it): the wrapped scorer the tests control."""

    name = "given_scores"

    def score(self, layer: LayerView) -> torch.Tensor:
        return layer.attention.clone()


def one_head_view(scores: list[float]) -> LayerView:
    n = len(scores)
    return LayerView(keys=torch.zeros(1, 1, n, 4), values=torch.zeros(1, 1, n, 4),
                     positions=torch.arange(n)[None, None],
                     attention=torch.tensor(scores, dtype=torch.float32)[None, None], state={}, layers=0)


@pytest.mark.parametrize("scores, kept", [
    # both sum to 2^24 + 2 (a tie: the newer chunk); summed in float32 the second loses its ones, the first is kept
    ([2.0 ** 24, 2, 0, 0, 2.0 ** 24, 1, 1, 0], [4, 5, 6, 7]),
    # the documented precision: 2^25 + 1 and 2^25 (exact in float64) compare as float32 (spacing 4 there): a tie,
    # the newer chunk (a float64 ranking would keep the first)
    ([2.0 ** 25, 1, 0, 0, 2.0 ** 25, 0, 0, 0], [4, 5, 6, 7]),
    ([2.0 ** 25, 4, 0, 0, 2.0 ** 25, 0, 0, 0], [0, 1, 2, 3]),  # 2^25 + 4 is a float32: the first wins
])
def test_chunk_sums_are_exact_and_ranked_in_float32_with_ties_to_the_newer_chunk(scores, kept):
    view = one_head_view(scores)
    assert kept_positions(Chunked(GivenScores(), chunk_length=4, scope="head"), view, 4) == [[kept]]


def test_build_and_describe_round_trip():
    policy = build_policy("snapkv", window=32, chunk_length=20, layer_budgets={"schedule": "pyramid", "beta": 20})
    described = policy.describe()
    assert described["chunk_length"] == 20
    assert list(described)[-3:] == ["chunk_length", "chunk_scope", "layer_budgets"]
    assert build_policy(**described).describe() == described
