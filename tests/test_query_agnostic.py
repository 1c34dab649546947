"""kvpress's query-agnostic protocol (`query_aware=false`): the tasks' context/question splits (RULER checked against
kvpress's own split rule and pipeline), the refusals, and generic tables that keep the two protocols apart."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from keydiff import prefill
from tests.test_runner import make_cfg, no_model_load  # noqa: F401 (no_model_load: a fixture)

pytestmark = pytest.mark.integration


def test_held_suffix_must_leave_a_context(model, prompt):
    with pytest.raises(ValueError, match="held_suffix"):
        prefill(model, prompt, "keydiff", 64, 32, held_suffix=prompt.shape[1])
    with pytest.raises(ValueError, match="held_suffix"):
        prefill(model, prompt, "keydiff", 64, 32, held_suffix=-1)


ROOT = Path(__file__).resolve().parents[1]
KVPRESS = json.loads((ROOT / "tests/data/ruler_pinned/kvpress_question_patterns.json").read_text(encoding="utf-8"))
KVPRESS_KIND = {"niah": "niah", "variable_tracking": "vt", "common_words_extraction": "cwe",
                "freq_words_extraction": "fwe", "qa": "qa"}


@pytest.fixture(scope="module")
def tokenizer(builtin_tokenizer):
    return builtin_tokenizer  # conftest: it marks the tests that use it real_model


def kvpress_split(text: str, kind: str) -> tuple[str, str, str]:
    """kvpress's `split_context_question` (evaluation/benchmarks/ruler/create_huggingface_dataset.py)."""
    question = re.compile(KVPRESS["QUESTION_PATTERNS"][kind])
    answer = re.compile(KVPRESS["ANSWER_PATTERNS"][kind])
    start = list(question.finditer(text))[-1].start()
    context, rest = text[:start], text[start:]
    cut = answer.search(rest).start()
    return context, rest[:cut], rest[cut:]


def kvpress_ids(tokenizer, context: str, question: str, answer_prefix: str) -> tuple[list[int], list[int]]:
    """kvpress's pipeline `preprocess`: context in the chat template, then question + end of turn + answer prefix."""
    if tokenizer.chat_template is None:
        context, suffix = (tokenizer.bos_token or "") + context, "\n"
    else:
        separator = "#" * (len(context) + 10)
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": context + separator}],
                                                 add_generation_prompt=True, tokenize=False, enable_thinking=False)
        context, suffix = rendered.split(separator)
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    return encode(context), encode(question + suffix + answer_prefix)


@pytest.mark.real_model
def test_ruler_split_is_kvpress_s_rule_on_every_fixture_task(tokenizer):
    """Every RULER task: the query-agnostic prompt is, id for id, what kvpress's split rule and pipeline make of it."""
    from keydiff.tasks.ruler import STANDARD_TASKS, Ruler

    assert tokenizer.chat_template  # the split below is the chat-template path of kvpress's pipeline
    task = Ruler(length=1024, num_samples=1, data_dir=str(ROOT / "tasks/fixtures/ruler"), answer_prefix_style="kvpress")
    task.validate()
    for sample in task.samples():
        name = sample.fields["task"]
        prompt = task.build_prompt(sample, tokenizer, None, query_aware=False)
        aware = task.build_prompt(sample, tokenizer, None)
        gen, plan = task.generator(name), task.plan(name, 0)
        example = gen.example(plan, prompt.info["example_size"]) if prompt.info["example_size"] is not None else ""
        user_text, answer_prefix = gen.render(plan, prompt.info["haystack_size"], example)
        context, question, prefix = kvpress_split(user_text + answer_prefix, KVPRESS_KIND[gen.kind])
        assert context and question.strip() and prefix.strip(), name
        context_ids, question_ids = kvpress_ids(tokenizer, context, question, prefix)
        assert prompt.context_tokens == len(context_ids), name
        assert prompt.input_ids == context_ids + question_ids, name
        assert prompt.info["question_token_index"] == prompt.context_tokens
        # the same haystack as the query-aware prompt (same fitted size), the same text
        assert tokenizer.decode(prompt.input_ids) == tokenizer.decode(aware.input_ids), name
        assert aware.context_tokens is None


def question_of(tokenizer, prompt) -> str:
    return tokenizer.decode(prompt.input_ids[prompt.context_tokens:])


@pytest.mark.real_model
def test_longbench_question_part_is_kvpress_s_per_dataset(tokenizer):
    """Every fixture dataset: the held part starts where kvpress's question template starts; the text is unchanged."""
    from keydiff.tasks import longbench as lb

    task = lb.LongBench(datasets=list(lb.ALL_21), data_dir=str(ROOT / "tasks/fixtures/longbench"), limit=1)
    task.validate()
    for sample in task.samples():
        dataset, record = sample.fields["dataset"], sample.fields["record"]
        prompt = task.build_prompt(sample, tokenizer, None, query_aware=False)
        aware = task.build_prompt(sample, tokenizer, None)
        question = lb.question_part(dataset, record)
        held = question_of(tokenizer, prompt)
        assert held.startswith(question.rstrip(" ")[: max(1, len(question) // 2)]), dataset
        context = tokenizer.decode(prompt.input_ids[: prompt.context_tokens])
        assert record["context"] in context and context + held == tokenizer.decode(prompt.input_ids), dataset
        assert tokenizer.decode(prompt.input_ids) == tokenizer.decode(aware.input_ids), dataset
    # The middle cut leaves the question whole at the end (a prompt cut to 200 tokens).
    sample = next(s for s in task.samples() if s.fields["dataset"] == "hotpotqa")
    prompt = task.build_prompt(sample, tokenizer, 200, query_aware=False)
    assert question_of(tokenizer, prompt).startswith("Question: " + sample.fields["record"]["input"])


@pytest.mark.real_model
def test_niah_and_phonebook_hold_their_question(tokenizer):
    from keydiff.tasks.niah import NeedleInAHaystack
    from keydiff.tasks.phonebook import Phonebook

    for style in ("storybook", "gkamradt"):
        task = NeedleInAHaystack(context_lengths=[600], depths=[50], prompt_style=style)
        sample = next(task.samples())
        prompt = task.build_prompt(sample, tokenizer, 8192, query_aware=False)
        opening = "Based on the content of the book, Question: " if style == "storybook" else task.question
        assert question_of(tokenizer, prompt).startswith(opening)
        assert task.needle.strip() in tokenizer.decode(prompt.input_ids[: prompt.context_tokens])
        assert prompt.info["question_token_index"] == prompt.context_tokens
    task = Phonebook(sizes=[8], books_per_size=1, queries_per_book=2)
    for sample in task.samples():
        prompt = task.build_prompt(sample, tokenizer, None, query_aware=False)
        name = sample.fields["prompt"].rsplit("\n", 1)[1]
        assert question_of(tokenizer, prompt).startswith(name)
        assert sample.fields["answer"] in tokenizer.decode(prompt.input_ids[: prompt.context_tokens])


@pytest.mark.unit
@pytest.mark.extended
def test_math500_refuses_query_agnostic_in_one_line(no_model_load):
    from keydiff.run.checks import ConfigError, check_run_config

    cfg = make_cfg("task=math500", f"task.data_dir={ROOT / 'tasks/fixtures/math500'}", "query_aware=false")
    message = r"query_aware=false is not valid for task 'math500'.*valid: query_aware=true"
    with pytest.raises(ConfigError, match=message) as error:
        check_run_config(cfg)
    assert "\n" not in str(error.value)


@pytest.mark.unit
def test_generic_tables_never_average_the_two_protocols():
    """Two runs of one configuration, one per protocol: two rows, the query-agnostic one's B says so."""
    import pandas as pd

    from keydiff.report import generic

    base = {"experiment": "adhoc", "task": "ruler_4k", "model": "m", "policy": "keydiff", "policy_name": "keydiff",
            "budget_label": "r0.5", "block_size": "128", "seed": 0, "limit": float("nan"), "complete": True,
            "samples": 13, "num_failed": 0, "score": 50.0}
    frame = pd.DataFrame([{**base, "query_aware": True}, {**base, "query_aware": False, "score": 30.0}])
    runs = generic.runs_of(frame)
    assert sorted(zip(runs["block_size"], runs["score"])) == [("128", 50.0), ("128-query-agnostic", 30.0)]
    older = generic.runs_of(frame.drop(columns="query_aware").iloc[:1])  # summaries before the switch
    assert older["block_size"].tolist() == ["128"]
