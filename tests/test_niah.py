"""Needle-in-a-Haystack: haystacks, needle insertion, prompts, scoring, summaries, one end-to-end check (SmolLM2's tokenizer)."""

from __future__ import annotations

import hashlib
from functools import partial
from pathlib import Path

import pytest

from keydiff.tasks.base import Sample, encode_user_turn
from keydiff.tasks.haystack import (PINNED, PINNED_SHA256, directory_haystack, is_prose_paragraph, load_haystack,
                                    prose_paragraphs, pydoc_haystack)
from keydiff.tasks.niah import (ANSWER, NEEDLE, NeedleInAHaystack, needle_recall, normalize_words,
                                paper_context_lengths, paper_depths, period_token_ids, rouge1_scores)

pytestmark = pytest.mark.unit

CONF = Path(__file__).resolve().parents[1] / "conf"


@pytest.fixture(scope="session")
def tokenizer(builtin_tokenizer):
    return builtin_tokenizer  # conftest: it marks the tests that use it real_model


@pytest.fixture(scope="session")
def periods(tokenizer):
    return period_token_ids(tokenizer)


def _needle_ids(tokenizer):
    return tokenizer(NEEDLE, add_special_tokens=False)["input_ids"]


def _find(haystack: list[int], needle: list[int]) -> list[int]:
    return [i for i in range(len(haystack) - len(needle) + 1) if haystack[i : i + len(needle)] == needle]


def test_paper_grid():
    assert paper_context_lengths() == [1000, 4222, 7444, 10667, 13889, 17111, 20333, 23556, 26778, 30000]
    assert paper_depths() == [0, 11, 22, 33, 44, 56, 67, 78, 89, 100]
    task = NeedleInAHaystack()
    assert (task.name, task.context_lengths, task.depths) == ("niah", paper_context_lengths(), paper_depths())
    assert (task.max_new_tokens, task.buffer, task.prompt_style) == (50, 200, "storybook")


@pytest.mark.extended
def test_yaml_grids():
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        paper = instantiate(compose("config", overrides=["task=niah"]).task, _convert_="all")
        small = instantiate(compose("config", overrides=["task=niah_small"]).task, _convert_="all")
    assert isinstance(paper, NeedleInAHaystack) and paper == NeedleInAHaystack()
    paper.validate()
    small.validate()
    assert small.context_lengths == [3000, 4000] and small.depths == [0, 50, 100]


def test_samples_order_and_limit():
    task = NeedleInAHaystack(context_lengths=[3000, 4000], depths=[0, 50, 100])
    ids = [s.id for s in task.samples()]
    assert ids == ["L3000/d0", "L3000/d50", "L3000/d100", "L4000/d0", "L4000/d50", "L4000/d100"]
    assert [s.id for s in NeedleInAHaystack(context_lengths=[3000, 4000], depths=[0, 50], limit=3).samples()] == [
        "L3000/d0", "L3000/d50", "L4000/d0"]
    assert next(task.samples()).fields == {"context_length": 3000, "depth": 0}


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
])
def test_validate_rejects(changes, message):
    with pytest.raises(ValueError, match=message):
        NeedleInAHaystack(**changes).validate()


def test_validate_rejects_dir_without_txt(tmp_path):
    (tmp_path / "notes.md").write_text("not a text haystack")
    with pytest.raises(ValueError, match="no .txt files"):
        NeedleInAHaystack(haystack_dir=str(tmp_path)).validate()


def test_prose_filter():
    assert is_prose_paragraph(["Assignment statements are used to bind names to values", "and to modify objects."])
    assert not is_prose_paragraph(["Too short to count."])
    assert not is_prose_paragraph(["   if x: raise AssertionError because it is indented code."])
    assert not is_prose_paragraph(["assert_stmt ::= \"assert\" expression and some more words here."])
    assert not is_prose_paragraph(["This paragraph has enough words but does not end with a stop"])
    assert not is_prose_paragraph(["x = 1; y = 2; z = 3; a = 4; b = 5; c = 6; d = 7; e = 8."])
    text = "Title\n*****\n\nFirst prose paragraph spans two lines of running\ntext and ends here.\n\n   code = 1\n"
    assert prose_paragraphs(text) == ["First prose paragraph spans two lines of running text and ends here."]


def test_pydoc_haystack():
    import pydoc_data.topics

    haystack = pydoc_haystack()
    source = Path(pydoc_data.topics.__file__)
    assert haystack.sources == {"pydoc_data/topics.py": hashlib.sha256(source.read_bytes()).hexdigest()}
    assert len(haystack.text.split()) > 20000
    assert "::=" not in haystack.text and ">>>" not in haystack.text
    assert NeedleInAHaystack(haystack_source="interpreter").data_sources() == haystack.sources  # the old source
    assert load_haystack(None, "interpreter").kind == "pydoc"


def test_the_default_haystack_is_pinned_in_the_repository_with_its_licence():
    """The default haystack is the repository's file, checked by sha256, recorded by hash, with the PSF licence beside it."""
    data = PINNED.read_bytes()
    assert hashlib.sha256(data).hexdigest() == PINNED_SHA256 == "a92bd30d61cfb0874b98a666bb37dda4c055a6eaaa524331393cc9d9ab03c473"
    haystack = load_haystack(None)
    assert haystack.kind == "pydoc_pinned" and haystack.text.encode("utf-8") == data
    assert haystack.sources == {"keydiff/tasks/data/pydoc_prose.txt": PINNED_SHA256}
    assert NeedleInAHaystack().data_sources() == haystack.sources  # what summary.json's "data" records
    assert len(haystack.text.split()) > 25000 and "::=" not in haystack.text
    notice = (PINNED.parent / "pydoc_prose.LICENSE.txt").read_text(encoding="utf-8")
    assert "PYTHON SOFTWARE FOUNDATION LICENSE VERSION 2" in notice and "Python Software Foundation;" in notice
    assert PINNED_SHA256 in notice


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
    assert haystack.sources["haystack/a_first.txt"] == hashlib.sha256((text_dir / "a_first.txt").read_bytes()).hexdigest()
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


@pytest.mark.parametrize("depth", [0, 11, 33, 50, 89, 100])
def test_insertion_at_sentence_boundary(tokenizer, periods, depth):
    length = 1500
    task = NeedleInAHaystack(context_lengths=[length], depths=[depth])
    made = task.insert_needle(tokenizer, length, depth)
    needle = _needle_ids(tokenizer)
    ids = made["ids"]
    assert len(ids) == length - 200  # haystack + needle = L - buffer
    assert made["context_tokens"] == length - 200 - len(needle)
    point = made["insertion_token"]
    assert _find(ids, needle) == [point]
    if depth == 0:
        assert point == 0 and ids[: len(needle)] == needle
    elif depth == 100:
        assert point == made["context_tokens"] and ids[-len(needle) :] == needle
    else:
        assert ids[point - 1] in periods  # the needle follows a sentence end
        assert tokenizer.decode(ids[point - 1]).rstrip().endswith(".")
        target = int(made["context_tokens"] * depth / 100)
        assert point <= target
        # nothing between the boundary and the target is a period token (it walked to the nearest one)
        assert not any(tok in periods for tok in ids[point:target + len(needle)][len(needle):])
        assert abs(made["realised_depth"] - depth) < 5


def test_period_tokens(tokenizer, periods):
    assert tokenizer.convert_tokens_to_ids(".") in periods
    assert all(tokenizer.decode([i]).rstrip().endswith(".") for i in periods)
    assert tokenizer.eos_token_id not in periods


def test_storybook_prompt(tokenizer):
    task = NeedleInAHaystack(context_lengths=[2000], depths=[50])
    sample = next(task.samples())
    prompt = task.build_prompt(sample, tokenizer, 8192)
    ids = prompt.input_ids
    made = task.insert_needle(tokenizer, 2000, 50)
    text = (
        f"This is a very long story book: <book> {made['text']} </book>.\n"
        "Based on the content of the book, Question: What is the best thing to do in San Francisco?\nAnswer:"
    )
    assert ids == encode_user_turn(tokenizer, text)
    assert tokenizer.decode(ids).startswith("<|im_start|>system\n")  # SmolLM2 chat template
    assert tokenizer.decode(ids).endswith("Answer:<|im_end|>\n<|im_start|>assistant\n")
    info = prompt.info
    assert info["prompt_tokens"] == len(ids) <= 2000
    assert info["haystack_tokens"] == 1800
    assert (info["context_length"], info["depth"]) == (2000, 50)
    assert tokenizer.decode(ids[info["needle_token_index"] : info["needle_token_index"] + 4]).startswith("The best")
    assert tokenizer.decode(ids[info["question_token_index"] :]).startswith("Based on the content of the book")
    settings = prompt.generation
    assert (settings.max_new_tokens, settings.do_sample) == (50, False)


def test_prompt_without_chat_and_gkamradt(tokenizer):
    plain = NeedleInAHaystack(context_lengths=[1200], depths=[0], chat=False)
    prompt = plain.build_prompt(next(plain.samples()), tokenizer, None)
    assert tokenizer.decode(prompt.input_ids).startswith("This is a very long story book: <book> \nThe best thing")
    assert prompt.info["needle_token_index"] is not None

    gk = NeedleInAHaystack(context_lengths=[1200], depths=[100], prompt_style="gkamradt")
    gk.validate()
    prompt = gk.build_prompt(next(gk.samples()), tokenizer, None)
    decoded = tokenizer.decode(prompt.input_ids)
    assert "You are a helpful AI bot that answers questions for a user." in decoded
    assert "What is the best thing to do in San Francisco? Don't give information outside the document" in decoded
    index = prompt.info["needle_token_index"]
    assert tokenizer.decode(prompt.input_ids[index : index + 4]).startswith("The best")


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
    good = task.score(Sample("L1000/d0", {}), " The best thing to do is eat a sandwich and sit in Dolores Park on a sunny day.")
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


@pytest.mark.real_model
def test_real_model_finds_the_needle_without_eviction():
    """SmolLM2-135M, full cache, plain greedy `generate`: the needle at mid depth of a ~1.5K-token prompt."""
    import torch

    from keydiff.models import ModelConfig, eos_token_ids, load_model

    model, tokenizer = load_model(ModelConfig())
    task = NeedleInAHaystack(context_lengths=[1500], depths=[50])
    sample = next(task.samples())
    prompt = task.build_prompt(sample, tokenizer, 8192)
    ids = torch.tensor([prompt.input_ids])
    stop = eos_token_ids(model, tokenizer)
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=prompt.generation.max_new_tokens, eos_token_id=stop, pad_token_id=stop[0])
    prediction = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    scores = task.score(sample, prediction)
    assert scores["needle_recall"] == 1.0, prediction
    assert scores["accuracy"] == 1.0


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
