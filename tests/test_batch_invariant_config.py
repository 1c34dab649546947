"""batch_invariant from the configuration to the decoding step, without triton: the key's checks (one line, before
the model loads) and on a CPU no token changed (the kernels: tests/test_batch_invariant.py)."""

from __future__ import annotations

import pytest
import torch

import keydiff
from keydiff.models import ModelConfig
from keydiff.run.checks import ConfigError, check_batch_invariant, check_run_config
from keydiff.testing import tiny_model
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


@pytest.mark.integration
def test_on_a_cpu_batch_invariant_changes_no_token():
    model = tiny_model()
    prompts = [torch.randint(0, 256, (1, n), generator=torch.Generator().manual_seed(n)) for n in (30, 45)]
    runs = {}
    for invariant in (False, True):
        requests = [keydiff.Request(keydiff.prefill(model, p, "keydiff", 24, 8), max_new_tokens=5, key=i)
                    for i, p in enumerate(prompts)]
        out = dict(keydiff.generate_batch(model, requests, 2, batch_invariant=invariant))
        runs[invariant] = [out[i].token_ids for i in range(2)]
    assert runs[True] == runs[False]
    state = keydiff.prefill(model, prompts[0], "keydiff", 24, 8)
    assert keydiff.generate(model, state, 5, batch_invariant=True).token_ids == runs[False][0]
