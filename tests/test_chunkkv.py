"""ChunkKV (keydiff.policies.chunkkv.Chunked) against the brute-force loops of tests/test_policy_contract.py (which
also checks every eviction of a real prefill): whole chunks, scopes, exact sums, parameters."""

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
    positions = torch.stack([torch.stack([torch.randperm(span, generator=g)[:n] for _ in range(heads)]) for _ in range(batch)])
    return LayerView(keys=torch.randn(batch, heads, n, 8, generator=g), values=torch.randn(batch, heads, n, 8, generator=g),
                     positions=positions, attention=torch.rand(batch, heads, n, generator=g), state={}, layers=0)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("chunk_length", [1, 3, 20])
@pytest.mark.parametrize("scorer", [KNorm(), SnapKV(window=8)], ids=["knorm", "snapkv"])
@pytest.mark.parametrize("scope", ["layer", "head"])
def test_random_views_keep_what_the_reference_keeps(seed, chunk_length, scorer, scope):
    layer, budget = random_view(seed), 41
    policy = Chunked(scorer, chunk_length=chunk_length, scope=scope)
    scores, protected = scores_and_protected(policy, layer, budget)  # the chunk sums by loops
    expected = [choose(*row, [budget] * len(row[0])) for row in zip(scores, protected, layer.positions.tolist())]
    assert kept_positions(policy, layer, budget) == expected


def test_layer_scope_keeps_the_same_chunks_in_every_head():
    """Heads holding the same positions keep the same chunks with scope "layer" (one set per layer, as kvpress
    and the paper's index reuse), and different ones with scope "head" on the same scores."""
    layer, budget = random_view(5, n=200, span=200), 90
    same = kept_positions(Chunked(KNorm(), chunk_length=20, scope="layer"), layer, budget)
    per_head = kept_positions(Chunked(KNorm(), chunk_length=20, scope="head"), layer, budget)
    assert all(head == row[0] for row in same for head in row)
    assert any(head != row[0] for row in per_head for head in row)


def test_whole_chunks_are_kept_and_only_one_is_cut():
    """With contiguous positions and no protection, every chunk is kept whole or not at all, except one."""
    layer, budget, length = random_view(7, n=200, span=200), 90, 20
    kept = kept_positions(Chunked(KNorm(), chunk_length=length), layer, budget)
    for row in kept:
        for head in row:
            counts = torch.bincount(torch.tensor(head) // length, minlength=10).tolist()
            assert sum(c not in (0, length) for c in counts) == 1 and sorted(counts)[-4:] == [length] * 4


@pytest.mark.integration
@pytest.mark.extended
@pytest.mark.parametrize("name,params", [("snapkv", {"window": 8}), ("keydiff", {"window_fraction": 0.2})])
def test_chunk_length_one_is_the_wrapped_scorer(name, params):
    from keydiff.engine import generate, prefill
    from tests.conftest import tiny_llama

    model = tiny_llama()
    prompt = torch.randint(0, 256, (1, 300), generator=torch.Generator().manual_seed(3))
    outputs = []
    # per head: a chunk of one position is the entry itself (per layer it would sum the heads' scores)
    for policy in (build_policy(name, **params), build_policy(name, chunk_length=1, chunk_scope="head", **params)):
        with torch.no_grad():
            state = prefill(model, prompt, policy, budget=64, block_size=32)
            kept = [p.sort(dim=-1).values.tolist() for p in state.kept_positions]
            outputs.append((kept, generate(model, state, max_new_tokens=4).token_ids))
    assert outputs[0] == outputs[1]


def test_build_and_describe_round_trip():
    policy = build_policy("snapkv", window=32, chunk_length=20, layer_budgets={"schedule": "pyramid", "beta": 20})
    described = policy.describe()
    assert described["chunk_length"] == 20 and list(described)[-3:] == ["chunk_length", "chunk_scope", "layer_budgets"]
    assert build_policy(**described).describe() == described
    assert policy.needs.rows_alike and policy.needs.attention_rows == 32


@dataclass
class GivenScores(Policy):
    """Scores each entry by the view's `attention` (the test sets it): the wrapped scorer the tests control."""

    name = "given_scores"

    def score(self, layer: LayerView) -> torch.Tensor:
        return layer.attention.clone()


def one_head_view(scores: list[float]) -> LayerView:
    n = len(scores)
    return LayerView(keys=torch.zeros(1, 1, n, 4), values=torch.zeros(1, 1, n, 4), positions=torch.arange(n)[None, None],
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
