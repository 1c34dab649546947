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
