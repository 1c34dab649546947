"""The README's `make run ARGS="..."` examples evict on the default task: every prompt of the samples they run is longer
than the budget (the real tokenizer on the prompts built, no model loaded)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from keydiff.run.plan import plan_run
from tests.test_runner import make_cfg

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]


def readme_run_examples() -> list[list[str]]:
    """The overrides of every `make run ARGS="..."` in README.md."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    return [shlex.split(args) for args in dict.fromkeys(re.findall(r'make run ARGS="([^"]+)"', text))]


def test_the_readme_has_run_examples():
    examples = readme_run_examples()
    assert examples and all(any(o.startswith("budget=") for o in overrides) for overrides in examples)


@pytest.mark.parametrize("overrides", readme_run_examples(), ids=" ".join)
def test_every_readme_run_example_evicts_on_the_default_task(builtin_tokenizer, overrides):
    plan = plan_run(make_cfg(*overrides))
    samples = list(plan.task.samples())
    assert plan.budget is not None and samples
    lengths = [plan.compressed_tokens(plan.build_prompt(sample, builtin_tokenizer)) for sample in samples]
    assert min(lengths) > plan.budget, (
        f"`make run ARGS=\"{' '.join(overrides)}\"` would evict nothing on some sample: budget {plan.budget}, "
        f"prompts of {min(lengths)}..{max(lengths)} tokens")
