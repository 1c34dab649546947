"""Bring your own policy: examples/my_policy.py run through run.py from outside the package, and bad targets."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from keydiff import build_policy, prefill
from keydiff.run import runner
from keydiff.config import custom_policy_label
from tests.test_runner import make_cfg, no_model_load  # noqa: F401  (no_model_load: the fixture)

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


@pytest.fixture
def examples_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))


@pytest.mark.real_model
def test_example_policy_runs_end_to_end_through_run_py_from_outside_the_package(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(EXAMPLES)]), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, str(ROOT / "run.py"), "policy=custom", "policy.target=my_policy.MyPolicy",
               "+policy.params.alpha=0.3", "task.context_lengths=[400]", "task.depths=[25,75]", "task.limit=1",
               "budget.tokens=128", "block_size=64", f"results_root={tmp_path / 'runs'}"]
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    # 1 of 2 samples: a subset run, its own directory
    run_dir = tmp_path / "runs/adhoc/niah_small/smollm2-135m/MyPolicy-alpha0.3/128/bs64/seed0-limit1"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["policy"] == {"name": "my_policy.MyPolicy", "alpha": 0.3, "sinks": 4, "layer_budgets": None}
    assert summary["statistics"]["samples"] == 1 and summary["statistics"]["cache_bound_held"] is True
    row = json.loads((run_dir / "predictions.jsonl").read_text().splitlines()[0])
    assert row["kept_tokens"] == 128 and row["prompt_tokens"] > 128  # it really evicted


@pytest.mark.integration
def test_example_policy_keeps_what_its_score_says(examples_on_path):
    """One block, one eviction: the sinks plus the largest value norms of a plain forward's cache (brute force)."""
    from my_policy import MyPolicy
    from tests.conftest import tiny_llama

    model, ids = tiny_llama(), torch.randint(0, 256, (1, 120), generator=torch.Generator().manual_seed(0))
    policy = build_policy("my_policy.MyPolicy", alpha=0.0, sinks=2)
    assert isinstance(policy, MyPolicy)
    state = prefill(model, ids, policy, budget=40, block_size=None)
    with torch.no_grad():
        reference = model(ids, use_cache=True).cache
    for layer, kept in enumerate(state.kept_positions):
        norms = reference.layers[layer].values[0].norm(dim=-1)  # [kv_heads, 120]
        for head in range(norms.shape[0]):
            ranked = sorted(range(2, 120), key=lambda i: -float(norms[head, i]))
            assert kept[0, head].tolist() == sorted([0, 1] + ranked[:38])


@pytest.mark.extended
def test_label_is_derived_from_class_and_parameters():
    cfg = make_cfg("policy=custom", "policy.target=my_lab.policies.MyPolicy", "+policy.params.alpha=0.3")
    assert cfg.policy.label == "MyPolicy-alpha0.3" and "/MyPolicy-alpha0.3/2k/" in cfg.run_subdir
    assert custom_policy_label("a.B", {"beta": [1, 2], "alpha": 0.5}) == "B-alpha0.5-beta_1_2_"
    assert custom_policy_label("a.B", {}) != custom_policy_label("a.B", {"alpha": 0.5})


@pytest.mark.extended
@pytest.mark.parametrize(
    "overrides, message",
    [
        (["policy.target=no_such_lab.policies.MyPolicy"], "cannot import module 'no_such_lab.policies'"),
        (["policy.target=my_policy.NoSuchPolicy"], "module 'my_policy' has no attribute 'NoSuchPolicy'"),
        (["policy.target=collections.OrderedDict"], "is not a subclass of keydiff.policies.Policy"),
        (["policy.target=my_policy.MyPolicy", "+policy.params.beta=1"],
         r"no parameter\(s\) beta; valid: alpha, sinks, chunk_length, chunk_scope, critical, critical_epsilon, "
         "first_stage_ratio, head_budgets, alpha_safeguard, head_scores, key_rerotation, layer_budgets"),
        (["policy.target=my_policy.MyPolicy", "+policy.params.sinks=4096"], r"sinks \(4096\) must be in"),
        ([], "policy=custom needs policy.target"),
    ],
)
def test_bad_targets_fail_before_the_model_loads(tmp_path, examples_on_path, no_model_load, overrides, message):
    with pytest.raises(ValueError, match=message):
        runner.run(make_cfg("policy=custom", *overrides), tmp_path / "run")
    assert not (tmp_path / "run").exists()


@pytest.mark.integration
def test_example_policy_passes_check_policy_as_the_docs_show(examples_on_path):
    from my_policy import MyPolicy

    from keydiff.testing import check_policy

    summary = check_policy(MyPolicy, alpha=0.3)
    assert summary["policy"] == "my_policy.MyPolicy" and summary["evictions"] > 0
    assert summary["stacked"] and summary["batchable_checked"] and summary["captured_checked"]  # its needs' claims


@pytest.mark.extended
@pytest.mark.parametrize("argv, expected", [
    # the README's custom policy without `+`: the line says how to add the parameter, with the value as given
    (["policy=custom", "policy.target=my_policy.MyPolicy", "policy.params.alpha=0.3"],
     "policy.params.alpha is not a key of policy.params; valid: none (a key no config file lists is added with +: "
     "+policy.params.alpha=0.3)"),
    # a class not importable here: its parameters are checked when the run is planned, the hint stands
    (["policy=custom", "policy.target=nowhere.Mine", "policy.params.alpha=0.3"], "(a key no config file lists is "
     "added with +: +policy.params.alpha=0.3)"),
    # a built-in policy's own field that its file does not list
    (["policy=keydiff", "policy.params.critical=true"], "(a key no config file lists is added with +: "
     "+policy.params.critical=true)"),
    # not a parameter of the policy at all: its parameters, no `+` for this one
    (["policy=custom", "policy.target=my_policy.MyPolicy", "policy.params.beta=1"],
     "policy.params.beta is not a parameter of policy my_policy.MyPolicy; valid: alpha, sinks, chunk_length,"),
    (["model.device_map=auto"], "(a key no config file lists is added with +: +model.device_map=auto)"),
    # a typo gets no hint
    (["model.devicemap=auto"], "model.devicemap is not a key of model; valid: attn_implementation,"),
    (["policy.parms.alpha=1"], "policy.parms is not a key of policy; valid: label, name, params"),
])
def test_an_unlisted_key_is_told_to_use_plus(examples_on_path, capsys, argv, expected):
    from keydiff.run.checks import check_command_line

    with pytest.raises(SystemExit) as stop:
        check_command_line(argv, ROOT / "conf")
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.startswith("error: ") and err.count("\n") == 1 and expected in err, err
    assert ("added with +" in err) == ("added with +" in expected), err
