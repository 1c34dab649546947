"""Model signals (keydiff/signals.py): asking for one is checked, and an eviction without it is refused naming it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch

from keydiff import signals as model_signals
from keydiff.cache import EvictingCache
from keydiff.policies.base import LayerView, Needs, Policy
from tests.conftest import tiny_llama

pytestmark = pytest.mark.integration


@pytest.fixture
def last_output():
    """A signal registered for one test (each pass's last attention output row), and a policy that asks for it."""
    signal = model_signals.register(model_signals.Signal(
        "test_last_output", "the last attention output", lambda kept, step: step.output[:, -1].clone()))

    @dataclass
    class LastOutput(Policy):
        needs: ClassVar[Needs] = Needs(signals=("test_last_output",))

        def score(self, layer: LayerView) -> torch.Tensor:
            return layer.keys.norm(dim=-1)

    yield signal, LastOutput
    del model_signals.SIGNALS[signal.name]


def test_an_eviction_without_an_asked_signal_is_refused_naming_it(last_output):
    model = tiny_llama()
    cache = EvictingCache(last_output[1](), 8, 3, block_size=8)
    with torch.no_grad():  # no keydiff_attention: nobody hands the pass over
        model(input_ids=torch.arange(12)[None], cache=cache, use_cache=True)
        with pytest.raises(RuntimeError, match="needs the last attention output but none were recorded in layer 0"):
            cache.evict()


@pytest.mark.unit
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
        model_signals.register(last_output[0])

