"""Model signals (keydiff/signals.py): a policy may ask only for a registered one, and not with rows_alike."""

from __future__ import annotations

import pytest

from keydiff import signals as model_signals
from keydiff.policies.base import Needs

pytestmark = pytest.mark.unit


@pytest.fixture
def last_output():
    """A signal registered for one test: each pass's last attention output row."""
    signal = model_signals.register(model_signals.Signal(
        "test_last_output", "the last attention output", lambda kept, step: step.output[:, -1].clone()))
    yield signal
    del model_signals.SIGNALS[signal.name]


def test_needs_names_only_registered_signals_and_not_with_rows_alike(last_output):
    with pytest.raises(ValueError, match="unknown model signal 'nope'; valid: (.*, )?test_last_output"):
        Needs(signals=("nope",))
    with pytest.raises(ValueError, match="scores layer by layer"):
        Needs(signals=("test_last_output",), rows_alike=True)
    assert Needs(signals=["test_last_output"]).signals == ("test_last_output",)
    assert not Needs(signals=("test_last_output",)).groupable
    assert model_signals.asked(Needs(attention_rows=1, queries=True)) == (model_signals.ATTENTION,
                                                                          model_signals.QUERIES)
    with pytest.raises(ValueError, match="already registered"):
        model_signals.register(last_output)


@pytest.mark.integration
def test_a_fork_shares_the_model_weight_and_copies_the_query_statistics():
    import torch

    from keydiff.attention import keydiff_attention
    from keydiff.cache import EvictingCache
    from keydiff.policies import build_policy
    from tests.conftest import tiny_llama

    model = tiny_llama()
    ids = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(1))
    caches = {}
    for name, params in (("knorm", {"critical": True}), ("expected_attention", {"n_sink": 0})):
        cache = EvictingCache(build_policy(name, **params), 8, 3, block_size=8, config=model.config)
        with torch.no_grad(), keydiff_attention(model, cache):
            model(input_ids=ids, cache=cache, use_cache=True)
            cache.evict()
        caches[name] = (cache, cache.fork(1)[0])
    cache, fork = caches["knorm"]
    for layer, copied in zip(cache.layers, fork.layers):
        weight = layer.storage.signals.get(layer.plane, "output_projection")
        assert weight is model.model.layers[layer.layer_idx].self_attn.o_proj.weight
        assert copied.storage.signals.get(copied.plane, "output_projection") is weight
    cache, fork = caches["expected_attention"]
    for layer, copied in zip(cache.layers, fork.layers):
        assert copied.queries is not layer.queries and copied.queries.count == layer.queries.count == 24
        torch.testing.assert_close(copied.queries.total, layer.queries.total)
