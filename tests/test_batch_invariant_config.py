"""batch_invariant's checks, without triton: one line naming the valid choices, before the model loads (the kernels:
tests/test_batch_invariant.py)."""

from __future__ import annotations

import pytest

from keydiff.models import ModelConfig
from keydiff.run.checks import ConfigError, check_batch_invariant, check_run_config
from tests.test_runner import make_cfg

pytestmark = [pytest.mark.unit, pytest.mark.extended]


@pytest.mark.parametrize("overrides, message", [
    (["batch_invariant=maybe"], "batch_invariant must be true or false"),
    (["batch_invariant=true", "policy=lagkv"],
     r"policy=lagkv: its scores use reductions .*\(valid: full, h2o, keydiff, "),
    (["batch_invariant=true", "policy=expected_attention"], r"policy=expected_attention"),
    (["batch_invariant=true", "policy=adakv_keydiff"],
     r"head-adaptive budgets \(policy.params.head_budgets=adakv\); valid: head_budgets=uniform"),
    (["batch_invariant=true", "policy=chunkkv"], r"policy.params.chunk_length .*valid: without it"),
])
def test_bad_values_and_combinations_its_kernels_do_not_cover_are_refused_in_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message) as error:
        check_run_config(make_cfg(*overrides))
    assert "\n" not in str(error.value)
    check_run_config(make_cfg(*overrides[1:]))  # without the key the same run is valid
    check_run_config(make_cfg("batch_invariant=true"))  # keydiff, sdpa, cpu: valid


@pytest.mark.integration
@pytest.mark.parametrize("model, message", [
    (dict(attn_implementation="flash_attention_2", dtype="bfloat16"), r"flash_attention_2 .*valid: sdpa, eager"),
    (dict(device="mps"), r"model.device=mps; valid: cuda \(cpu: a no-op\)"),
    (dict(device_map="auto"), r"model.device_map=auto: .*valid: model.device_map=null"),
])
def test_devices_and_kernels_without_an_invariant_form_are_refused(model, message):
    """On the function: through the run, flash_attention_2 and MPS are refused earlier (not installed, absent)."""
    with pytest.raises(ConfigError, match=message):
        check_batch_invariant(make_cfg("batch_invariant=true"), ModelConfig(**model))
    check_batch_invariant(make_cfg(), ModelConfig(**model))  # false: nothing to refuse
