"""keydiff.run.runner in this process: config checks before the model loads."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from keydiff.run import runner
from keydiff.run.plan import plan_run

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
# runs go where each test says; results_root is only checked for writability and names W&B runs: never created
OUTSIDE_RESULTS = f"results_root={Path(tempfile.gettempdir()) / 'keydiff-tests' / 'runs'}"


def make_cfg(*overrides: str):
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        return compose("config", overrides=[OUTSIDE_RESULTS, *overrides])


@pytest.fixture
def no_model_load(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("the model must not be loaded")

    monkeypatch.setattr(runner, "load_model", fail)


@pytest.mark.extended
@pytest.mark.parametrize(
    "overrides, message",
    [
        (["policy=sink", "budget.tokens=4"], "sink count .4. must be smaller than the budget"),
        (["+policy.params.bogus=1"], "valid: anchor, metric, window_fraction"),
        (["model.dtype=float8"], "model.dtype='float8' is not valid"),
        (["task.depths=[150]"], r"depths entries must be integers in \[0, 100\], got 150"),
        (["task=niah"], r"exceed the model's max_length \(8192\)"),
    ],
)
def test_bad_values_fail_before_the_model_loads(tmp_path, no_model_load, overrides, message):
    with pytest.raises(ValueError, match=message):
        runner.run(make_cfg(*overrides), tmp_path / "run")


@pytest.mark.extended
def test_block_size_inf_is_accepted(no_model_load):
    assert plan_run(make_cfg("block_size=inf")).block_size is None


def niah_cfg(*extra: str):
    return make_cfg("task=niah_small", "task.context_lengths=[700,900]", "task.depths=[50]", *extra)


# One value each rule of keydiff.run.checks.VALUES refuses, in the table's order.
REFUSED_VALUES = ["block_size=abc", "attention_statistics=weights", "seed=1.5", "decode_eviction=1",
                  "query_aware=maybe", "batch_invariant=null", "overwrite=yes", "retry_failed=0", "dry_run=maybe",
                  "threads=0", "max_prompt_tokens=-1", "batch_size=2.0", "lock_wait=-1", "task.limit=0",
                  "budget.tokens=0", "budget=r0.25 budget.ratio=2"]


def test_every_value_rule_is_exercised():
    from keydiff.run.checks import VALUES

    assert [override.split()[-1].split("=")[0] for override in REFUSED_VALUES] == list(VALUES)


@pytest.mark.parametrize("override", REFUSED_VALUES)
def test_a_refused_value_is_one_line_naming_the_valid_values(override):
    from keydiff.run.checks import ConfigError, check_run_config

    with pytest.raises(ConfigError) as error:
        check_run_config(make_cfg(*override.split()))
    line = str(error.value)
    assert "\n" not in line and line.startswith(override.split()[-1].split("=")[0]), line
    assert "valid: " in line or " must be " in line, line  # what is valid


def test_a_sweep_of_known_keys_passes_the_command_line_check():
    from keydiff.run.checks import check_command_line

    check_command_line(["-m", "policy=keydiff,tova", "block_size=64,128"], ROOT / "conf")
