"""Math-500: answer extraction, Exact/Flex scoring, prompts, subsets and configuration errors (offline)."""

from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path

import pytest

from keydiff.tasks.fixture_builders import math500 as math500_fixture
from keydiff.tasks.math500 import PROMPT_SUFFIX, Math500, ids_exceeding, subset_by_ids, subset_exceeding
from keydiff.tasks.math_answers import (
    exact_match, extract_boxed_answer, flex_match, is_equiv, normalize_answer, score_response,
)
from tests.conftest import char_tokenizer

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tasks" / "fixtures" / "math500"


def text_of(tokenizer, ids: list[int]) -> str:
    return "".join(tokenizer.convert_ids_to_tokens(ids))


TEMPLATE = (
    "{% for m in messages %}<|user|>{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.mark.parametrize(("response", "expected"), [
    ("so $x = \\boxed{\\frac{1}{2}}$.", "\\frac{1}{2}"),
    ("\\boxed{\\left[ -1, \\frac{3}{2} \\right)}", "\\left[ -1, \\frac{3}{2} \\right)"),
    ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),
    ("first \\boxed{1}, then \\boxed{2}", "2"),
    ("\\fbox{3}", "3"),
    ("\\boxed{4} and finally \\fbox{\\sqrt{5}}", "\\sqrt{5}"),
    ("$\\boxed 7$ is it", "7"),
    ("\\boxed{\\text{Thursday}}", "\\text{Thursday}"),
    ("no box here, the answer is 3", None),
    ("\\boxed{1} ... \\boxed{\\frac{1}{", None),  # last box cut off: no answer
    ("\\boxed{}", ""),
    # boxes inside the reasoning do not count once the reasoning is closed
    ("<think>try \\boxed{5}</think>So \\boxed{7}.", "7"),
    ("<think>try \\boxed{5}</think>The answer is 7.", None),
    ("a</think>b \\boxed{1}</think>c \\boxed{2}", "2"),  # the last </think>
    ("<think>so \\boxed{9} and then", "9"),  # an unfinished reasoning (truncated) is searched whole
])
def test_extract_boxed_answer(response, expected):
    assert extract_boxed_answer(response) == expected


@pytest.mark.parametrize(("raw", "normalised"), [
    ("\\dfrac{14}{3}", "\\frac{14}{3}"),
    ("\\tfrac12", "\\frac{1}{2}"),
    ("\\frac1{b}", "\\frac{1}{b}"),
    ("14/3", "\\frac{14}{3}"),
    ("x/3", "x/3"),
    ("0.5", "\\frac{1}{2}"),
    (".5", "\\frac{1}{2}"),
    ("x = 5", "5"),
    ("90^\\circ", "90"),
    ("90^{\\circ}", "90"),
    ("\\sqrt3", "\\sqrt{3}"),
    ("10\\text{ cm}", "10"),
    ("50\\%", "50"),
    ("\\$32,\\!348", "32,348"),
    ("\\left( 3, \\frac{\\pi}{2} \\right)", "(3,\\frac{\\pi}{2})"),
    ("\\text{(C)}", "\\text{(C)}"),
    ("a\nb", "ab"),
])
def test_normalize_answer(raw, normalised):
    assert normalize_answer(raw) == normalised


def test_is_equiv():
    assert not is_equiv(None, "1")
    # several "\text{ " units: the reference normaliser gives up and raw strings are compared
    assert is_equiv("1\\text{ a}\\text{ b}", "1\\text{ a}\\text{ b}")
    assert not is_equiv("1\\text{ a}\\text{ b}", "1")


# Exact vs Flex: the table in docs/design/tasks.md, "Math-500"
BOX_IN_CLOSED_REASONING = "<think>\\boxed{\\frac12}</think>I give up."  # no answer: has_answer 0, as without a box


@pytest.mark.parametrize(("gold", "response", "exact", "flex"), [
    ("\\left( 3, \\frac{\\pi}{2} \\right)", "\\boxed{(3, \\frac{\\pi}{2})}", 1, 1),
    ("\\frac{14}{3}", "\\boxed{\\dfrac{14}{3}}", 1, 1),
    ("\\frac{14}{3}", "\\boxed{14/3}", 1, 1),
    ("\\text{(C)}", "\\boxed{C}", 0, 1),
    ("3\\sqrt{13}", "\\boxed{\\sqrt{117}}", 0, 1),
    ("10", "the answer is 10", 0, 1),
    ("\\$32,\\!348", "\\boxed{32348}", 0, 1),
    ("90^\\circ", "\\boxed{90}", 1, 1),
    ("\\frac{1}{4}", "\\boxed{0.25}", 0, 1),
    ("\\frac{1}{2}", "\\boxed{0.5}", 1, 1),
    ("\\frac{1}{2}", "\\boxed{\\frac{1}{3}}", 0, 0),
    ("\\frac{1}{2}", BOX_IN_CLOSED_REASONING, 0, 0),
    # math-verify reads close boxes as the set {1, 2}: Flex falls back on Exact's last box
    ("2", "first \\boxed{1}, then \\boxed{2}", 1, 1),
    ("1", "first \\boxed{1}, then \\boxed{2}", 0, 0),
])
def test_exact_and_flex(gold, response, exact, flex):
    assert exact_match(response, gold) == bool(exact)
    assert flex_match(response, gold) == bool(flex)
    scores = score_response(response, gold)
    assert scores["exact"] == exact and scores["flex"] == flex
    assert scores["has_answer"] == (0.0 if response in ("the answer is 10", BOX_IN_CLOSED_REASONING) else 1.0)


@pytest.mark.parametrize("opens_think, think_token, ending, added", [
    (False, True, "<think>\n", True),
    (True, True, "<think>\n", False),  # a template that already opens the reasoning gets no second <think>
    (False, False, "", False),  # a model without a <think> token is left alone
], ids=["adds_think", "template_opens_think", "no_think_token"])
def test_prompt_with_chat_template_and_think(opens_think, think_token, ending, added):
    task = Math500(data_dir=str(FIXTURE))
    sample = next(iter(task.samples()))
    template = TEMPLATE.replace("<|assistant|>", "<|assistant|><think>\n") if opens_think else TEMPLATE
    tokenizer = char_tokenizer(template, ("<|user|>", "<|assistant|>") + (("<think>",) if think_token else ()))
    prompt = task.build_prompt(sample, tokenizer, max_length=None)
    expected = f"<|user|>{sample.fields['problem'] + PROMPT_SUFFIX}<|assistant|>{ending}"
    assert text_of(tokenizer, prompt.input_ids) == expected
    assert prompt.info["think_prefix_added"] is added


def test_validate_and_data_sources(tmp_path):
    Math500(data_dir=str(FIXTURE)).validate()
    with pytest.raises(ValueError, match="test.jsonl"):
        Math500(data_dir=str(tmp_path)).validate()
    with pytest.raises(ValueError, match="num_samples"):
        Math500(data_dir=str(FIXTURE), num_samples=0).validate()
    with pytest.raises(ValueError, match="top_p"):
        Math500(data_dir=str(FIXTURE), top_p=1.5).validate()
    digest = hashlib.sha256((FIXTURE / "test.jsonl").read_bytes()).hexdigest()
    assert list(Math500(data_dir=str(FIXTURE)).data_sources().values()) == [digest]


def test_fixture_is_what_the_builder_writes(tmp_path, capsys):
    math500_fixture.main(["--out", str(tmp_path)])
    assert (tmp_path / "test.jsonl").read_bytes() == (FIXTURE / "test.jsonl").read_bytes()
    assert "wrote 5 problems" in capsys.readouterr().out


def test_missing_datasets_message(monkeypatch):
    import sys

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "datasets" else real_find_spec(name, *a))
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` raises ImportError
    extra = r"needs the 'datasets' extra \(no module datasets\): pip install -e '\.\[datasets\]'; or task\.data_dir="
    with pytest.raises(ValueError, match=extra):  # a configuration error: one line before any model loads
        Math500().validate()
    with pytest.raises(ImportError, match=extra):
        list(Math500().samples())


def row(sample_id, exact, flex, has, prompt, new, reason, budget=1024, in_info=False):
    lengths = {"prompt_tokens": prompt, "new_tokens": new, "finish_reason": reason, "budget": budget}
    base = {"sample_id": sample_id, "scores": {"exact": exact, "flex": flex, "has_answer": has}}
    return {**base, "info": lengths} if in_info else {**base, **lengths}


ROWS = [
    row("p1#0", 1, 1, 1, 100, 900, "stop"),  # context 1000
    row("p1#1", 0, 1, 1, 100, 1500, "stop"),  # 1600
    row("p2#0", 0, 0, 0, 50, 2048, "length", in_info=True),  # 2098
    row("p2#1", 1, 1, 1, 50, 700, "stop"),  # 750
]


def test_subset_units_and_ids():
    assert ids_exceeding(ROWS, 1350) == {"p1#1", "p2#0"}
    assert ids_exceeding(ROWS, 1350, unit="problem_any") == {"p1#0", "p1#1", "p2#0", "p2#1"}
    assert ids_exceeding(ROWS, 1350, unit="problem_mean") == {"p2#0", "p2#1"}  # means 1300 and 1424
    assert [r["sample_id"] for r in subset_exceeding(ROWS, 1350)] == ["p1#1", "p2#0"]
    with pytest.raises(ValueError, match="sample.*problem_any.*problem_mean"):
        ids_exceeding(ROWS, 1350, unit="problem")

    # the paper's way: choose by the full-cache run, score another run on that choice
    other_run = [dict(r, scores={"exact": 1, "flex": 1, "has_answer": 1}, new_tokens=10) for r in ROWS]
    chosen = subset_by_ids(other_run, ids_exceeding(ROWS, 1350))
    assert [r["sample_id"] for r in chosen] == ["p1#1", "p2#0"]
    assert subset_exceeding(other_run, 1350) == []  # by its own lengths nothing exceeds


