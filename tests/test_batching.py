"""Many sequences from bounded caches: forking a prefilled state, and batched continuous decoding
(keydiff.batching), each checked against separate batch-1 runs (same tokens, same kept positions)."""

from __future__ import annotations

import pytest
import torch

import keydiff
from keydiff import available_policies, build_policy, generate, prefill

BUDGET, BLOCK = 40, 16
# Every registered policy, plus the wrappers and cache layouts that change how a cache is built.
VARIANTS = [(name, {}) for name in available_policies()] + [
    ("keydiff", {"head_budgets": "adakv"}),
    ("snapkv", {"head_budgets": "adakv", "window": 8}),
    ("keydiff", {"key_rerotation": "contiguous"}),
    ("keydiff", {"key_rerotation": True}),
    ("keydiff", {"window_fraction": 0.25}),
    ("keydiff", {"layer_budgets": {"schedule": "pyramid", "beta": 20}}),
    ("keydiff", {"critical": True}),
]
IDS = [name + "".join(f"-{k}={v}" for k, v in params.items()) for name, params in VARIANTS]


def prompts(lengths=(90, 23, 130, 61)) -> list[torch.Tensor]:
    """Prompts of different lengths, one shorter than the budget N (23 < 40)."""
    generator = torch.Generator().manual_seed(7)
    return [torch.randint(0, 256, (1, n), generator=generator) for n in lengths]


def kept(cache) -> list[torch.Tensor]:
    return [positions.clone() for positions in cache.kept_positions()]


def same_kept(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("name,params", VARIANTS, ids=IDS)
def test_fork_equals_separate_runs(model, name, params):
    ids = prompts()[0]
    state = prefill(model, ids, build_policy(name, **params), BUDGET, BLOCK)
    forks = state.fork(3)
    assert all(f.cache is not state.cache and f.cache.kv_cache_bytes == state.cache.kv_cache_bytes for f in forks)
    for seed, fork in zip((1, 2, 3), forks):
        alone = prefill(model, ids, build_policy(name, **params), BUDGET, BLOCK)
        expected = generate(model, alone, 12, do_sample=True, temperature=0.8, seed=seed)
        got = generate(model, fork, 12, do_sample=True, temperature=0.8, seed=seed)
        assert got.token_ids == expected.token_ids
        assert same_kept(kept(fork.cache), kept(alone.cache))
    # The forked-from state is untouched and still decodes like a fresh one.
    alone = prefill(model, ids, build_policy(name, **params), BUDGET, BLOCK)
    assert generate(model, state, 12).token_ids == generate(model, alone, 12).token_ids


def test_fork_refuses_a_decoded_state(model):
    state = prefill(model, prompts()[0], "keydiff", BUDGET, BLOCK)
    generate(model, state, 2)
    with pytest.raises(RuntimeError, match="fork before generate"):
        state.fork(2)
    with pytest.raises(ValueError, match="positive integer"):
        prefill(model, prompts()[0], "keydiff", BUDGET, BLOCK).fork(0)
