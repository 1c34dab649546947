"""Needle-in-a-Haystack: the paper's grid, haystacks, scoring, summaries, configuration errors (SmolLM2's tokenizer)."""

from __future__ import annotations

import hashlib
from functools import partial
from pathlib import Path

import pytest

from keydiff.tasks.base import Sample
from keydiff.tasks.haystack import PINNED, directory_haystack, load_haystack, pydoc_haystack
from keydiff.tasks.niah import (ANSWER, NEEDLE, NeedleInAHaystack, needle_recall, normalize_words,
                                paper_context_lengths, paper_depths, rouge1_scores)

pytestmark = pytest.mark.unit


@pytest.fixture(scope="session")
def tokenizer(builtin_tokenizer):
    return builtin_tokenizer  # conftest: it marks the tests that use it real_model


def test_paper_grid():
    assert paper_context_lengths() == [1000, 4222, 7444, 10667, 13889, 17111, 20333, 23556, 26778, 30000]
    assert paper_depths() == [0, 11, 22, 33, 44, 56, 67, 78, 89, 100]
    task = NeedleInAHaystack()
    assert (task.name, task.context_lengths, task.depths) == ("niah", paper_context_lengths(), paper_depths())
    assert (task.max_new_tokens, task.buffer, task.prompt_style) == (50, 200, "storybook")


@pytest.mark.parametrize(("changes", "message"), [
    ({"depths": [0, 101]}, r"\[0, 100\]"),
    ({"depths": [10.5]}, r"\[0, 100\]"),
    ({"context_lengths": [150]}, "larger than buffer"),
    ({"context_lengths": [1000, 1000]}, "must not repeat"),
    ({"prompt_style": "chatml"}, "storybook"),
    ({"recall_compat": "raw"}, "kvcache-factory"),
    ({"limit": -1}, "limit"),
    ({"haystack_dir": "/no/such/dir"}, "not a directory"),
    ({"context_lengths": []}, "at least one"),
    ({"haystack_source": "python"}, r"task.haystack_source='python' is not valid; valid: pinned, interpreter"),
    ({"haystack_dir": "{tmp}"}, "no .txt files"),
])
def test_validate_rejects(tmp_path, changes, message):
    changes = {k: v.format(tmp=tmp_path) if isinstance(v, str) else v for k, v in changes.items()}
    with pytest.raises(ValueError, match=message):
        NeedleInAHaystack(**changes).validate()


def test_pydoc_haystack():
    import pydoc_data.topics

    haystack = pydoc_haystack()
    source = Path(pydoc_data.topics.__file__)
    assert haystack.sources == {"pydoc_data/topics.py": hashlib.sha256(source.read_bytes()).hexdigest()}
    assert len(haystack.text.split()) > 20000
    assert "::=" not in haystack.text and ">>>" not in haystack.text
    assert NeedleInAHaystack(haystack_source="interpreter").data_sources() == haystack.sources  # the old source
    assert load_haystack(None, "interpreter").kind == "pydoc"


def test_a_changed_pinned_haystack_is_refused(tmp_path, monkeypatch):
    from keydiff.tasks import haystack as haystack_module

    changed = tmp_path / "pydoc_prose.txt"
    changed.write_bytes(PINNED.read_bytes() + b" ")
    monkeypatch.setattr(haystack_module, "PINNED", changed)
    with pytest.raises(RuntimeError, match="not the pinned"):
        load_haystack(None)


@pytest.fixture()
def text_dir(tmp_path):
    """Two small generated text files, named so that sorted order differs from creation order."""
    words = ["amber", "basalt", "cedar", "delta", "ember", "fjord", "granite", "harbor"] * 5
    for name, sentence in [("b_second", "The {} lantern number {} hangs above the second path. "),
                           ("a_first", "Every {} stone number {} rests beside the first river. ")]:
        (tmp_path / f"{name}.txt").write_text("".join(sentence.format(w, i) for i, w in enumerate(words)))
    (tmp_path / "ignored.md").write_text("This file is not a haystack file.")
    return tmp_path


def test_directory_haystack(text_dir, tokenizer):
    haystack = directory_haystack(text_dir)
    assert set(haystack.sources) == {"haystack/a_first.txt", "haystack/b_second.txt"}
    digest = hashlib.sha256((text_dir / "a_first.txt").read_bytes()).hexdigest()
    assert haystack.sources["haystack/a_first.txt"] == digest
    assert haystack.text.index("first river") < haystack.text.index("second path")
    assert "not a haystack" not in haystack.text

    base_tokens = len(tokenizer(haystack.text, add_special_tokens=False)["input_ids"])
    length = 3 * base_tokens + 500  # forces the files to be repeated
    task = NeedleInAHaystack(context_lengths=[length], depths=[50], haystack_dir=str(text_dir))
    task.validate()
    assert task.data_sources() == haystack.sources
    made = task.insert_needle(tokenizer, length, 50)
    assert len(made["ids"]) == length - 200
    assert made["text"].count("first river") > 40 * 2  # repeated beyond one copy


def test_context_longer_than_max_length(tokenizer):
    task = NeedleInAHaystack(context_lengths=[9000], depths=[0])
    with pytest.raises(ValueError, match="max_length"):
        task.build_prompt(next(task.samples()), tokenizer, 8192)


ROUGE1 = partial(rouge1_scores, reference=NEEDLE)
RAW = partial(needle_recall, compat="kvcache-factory")


@pytest.mark.parametrize("metric, text, expected", [
    (normalize_words, "Eat a SANDWICH, in Dolores-Park… on a “sunny” day!",
     ["eat", "a", "sandwich", "in", "dolores", "park", "on", "a", "sunny", "day"]),
    (needle_recall, NEEDLE, 1.0),
    (needle_recall, "The best thing is to eat a sandwich and sit in Dolores Park on a sunny day", 1.0),
    (needle_recall, "Eat a sandwich.", pytest.approx(3 / 11)),  # of the answer's 11 distinct words
    (needle_recall, "I don't know.", 0.0),
    (needle_recall, "", 0.0),
    (needle_recall, "EAT a Sandwich, sit in dolores park on a sunny day!", pytest.approx(10 / 11)),  # no "and"
    # KVCache-Factory's raw variant keeps punctuation: "day" does not match "day.", "Park," not "park".
    (RAW, "eat a sandwich and sit in Dolores Park on a sunny day", pytest.approx(10 / 11)),
    (RAW, "eat a sandwich and sit in Dolores Park on a sunny day.", 1.0),
    (RAW, "Sit in Dolores Park, on a sunny day.", pytest.approx(7 / 11)),
    (ROUGE1, "The best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day.",
     (pytest.approx(1.0, abs=1e-6), 1.0)),
    # The needle sentence has 19 distinct case-sensitive words; "eat a sandwich" has 3, all in it: (F, R).
    (ROUGE1, "eat a sandwich", (pytest.approx(2 * (3 / 19) / (1 + 3 / 19 + 1e-8)), pytest.approx(3 / 19))),
    (ROUGE1, "", (0.0, 0.0)),
    (ROUGE1, " ... ", (0.0, 0.0)),
])
def test_scores_hand_computed(metric, text, expected):
    assert metric(text) == expected


def test_score_and_summarize():
    assert len(set(normalize_words(ANSWER))) == 11  # needle_recall's denominator
    task = NeedleInAHaystack(context_lengths=[1000, 2000], depths=[0, 100])
    good = task.score(Sample("L1000/d0", {}), " The best thing is to eat a sandwich and sit in Dolores Park on a sunny "
                                              "day.")
    assert good["needle_recall"] == 1.0 and good["accuracy"] == 1.0 and good["rouge1"] > 0.8
    half = task.score(Sample("L1000/d100", {}), "Sit in Dolores Park.")
    assert half["needle_recall"] == pytest.approx(4 / 11) and half["accuracy"] == 0.0
    rows = [
        {"sample_id": "L1000/d0", "scores": good, "info": {"context_length": 1000, "depth": 0}},
        {"sample_id": "L1000/d100", "scores": half, "info": {"context_length": 1000, "depth": 100}},
        {"sample_id": "L2000/d0", "scores": {"needle_recall": 0.0, "accuracy": 0.0, "rouge1": 0.0}, "info": {}},
    ]
    summary = task.summarize(rows)
    assert summary["needle_recall"] == pytest.approx((1 + 4 / 11 + 0) / 3)
    assert summary["accuracy"] == pytest.approx(1 / 3)
    assert summary["n"] == 3
    assert summary["needle_recall_by_cell"] == {"1000": {"0": 1.0, "100": pytest.approx(4 / 11)}, "2000": {"0": 0.0}}
    assert summary["accuracy_by_cell"] == {"1000": {"0": 1.0, "100": 0.0}, "2000": {"0": 0.0}}
    assert summary["needle_recall_by_length"] == {"1000": pytest.approx((1 + 4 / 11) / 2), "2000": 0.0}
    assert summary["needle_recall_by_depth"] == {"0": 0.5, "100": pytest.approx(4 / 11)}


def test_a_run_from_before_the_pinned_haystack_resumes_with_the_interpreter_source(tmp_path):
    """Such a run resumes as haystack_source=interpreter; the default command is refused with that hint."""
    import json

    from omegaconf import OmegaConf

    from keydiff.run.plan import result_config
    from keydiff.run.results import ConfigMismatchError, ResultStore

    old = {"seed": 0, "task": {"name": "niah_small", "haystack_dir": None, "limit": None}}
    with_source = lambda source: {**old, "task": {**old["task"], "haystack_source": source}}  # noqa: E731
    assert result_config(OmegaConf.create(with_source("interpreter"))) == old
    assert result_config(OmegaConf.create(with_source("pinned")))["task"]["haystack_source"] == "pinned"
    (tmp_path / "run_config.json").write_text(json.dumps(old))
    with pytest.raises(ConfigMismatchError) as refused:
        ResultStore(tmp_path, with_source("pinned"))
    assert "task.haystack_source: '<missing>' -> 'pinned'" in str(refused.value)
    assert "task.haystack_source=interpreter" in str(refused.value)
    with pytest.raises(ConfigMismatchError) as refused:
        ResultStore(tmp_path, {**old, "seed": 1})
    assert "haystack_source" not in str(refused.value)  # other differences get no such hint
