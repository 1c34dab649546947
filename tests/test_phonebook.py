"""Phonebook lookup: book generation, prompt format, scoring and per-size summary (offline)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from keydiff.tasks.phonebook import DEFAULT_SIZES, Phonebook, book_seed, generate_book
from tests.conftest import char_tokenizer

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
ENTRY = re.compile(r"^([^:\n]+): ([6-9]\d{9})$")


def small(**overrides) -> Phonebook:
    settings = {"sizes": [5, 8], "books_per_size": 2, "queries_per_book": 2}
    return Phonebook(**{**settings, **overrides})


def test_default_sizes_are_the_papers():
    assert DEFAULT_SIZES == np.round(np.linspace(100, 3500, 10)).astype(int).tolist()
    assert DEFAULT_SIZES[:3] == [100, 478, 856] and DEFAULT_SIZES[-1] == 3500


@pytest.mark.extended
def test_book_is_deterministic_and_unique():
    book = generate_book(3500, seed=123)
    assert generate_book(3500, seed=123) == book
    assert generate_book(3500, seed=124) != book
    names = [name for name, _ in book]
    phones = [phone for _, phone in book]
    assert len(book) == 3500 and len(set(names)) == 3500 and len(set(phones)) == 3500
    assert all(ENTRY.match(f"{name}: {phone}") for name, phone in book)
    assert all(len(name.split(" ")) >= 2 for name in names)


def test_book_seeds_are_independent():
    seeds = {book_seed(0, size, b) for size in DEFAULT_SIZES for b in range(5)}
    assert len(seeds) == 50
    assert book_seed(1, 100, 0) not in seeds


def test_sample_ids_order_and_determinism():
    samples = list(small().samples())
    assert [s.id for s in samples] == [
        "n5/b0/q0", "n5/b0/q1", "n8/b0/q0", "n8/b0/q1",
        "n5/b1/q0", "n5/b1/q1", "n8/b1/q0", "n8/b1/q1",
    ]  # fmt: skip
    again = list(small().samples())
    assert [s.fields for s in again] == [s.fields for s in samples]
    other_seed = list(small(seed=1).samples())
    assert all(a.fields["prompt"] != b.fields["prompt"] for a, b in zip(samples, other_seed))

    # books depend only on (seed, size, book): other sizes or more queries leave them unchanged
    by_id = {s.id: s.fields["book_sha256"] for s in samples}
    fewer = {s.id: s.fields["book_sha256"] for s in small(sizes=[8], queries_per_book=1).samples()}
    assert fewer == {"n8/b0/q0": by_id["n8/b0/q0"], "n8/b1/q0": by_id["n8/b1/q0"]}


def test_limit_covers_sizes_first():
    limited = list(small(queries_per_book=1, limit=3).samples())
    assert [s.id for s in limited] == ["n5/b0/q0", "n8/b0/q0", "n5/b1/q0"]


def test_prompt_format_is_jelassi():
    for sample in small().samples():
        f = sample.fields
        book_part, shots_part, question = f["prompt"].split("\n\n")
        lines = book_part.split("\n")
        assert len(lines) == f["size"] and all(ENTRY.match(line) for line in lines)
        shots = shots_part.split("\n")
        assert len(shots) == 2 and all(shot in lines for shot in shots)
        assert question == f["query_name"] + ":"
        assert lines[f["query_index"]] == f"{f['query_name']}: {f['answer']}"
        assert [lines[i] for i in f["fewshot_indices"]] == shots
        assert f["query_index"] not in f["fewshot_indices"]
    queries = [s.fields["query_index"] for s in small().samples() if s.id.startswith("n8/b0/")]
    assert len(set(queries)) == 2  # queries of one book are distinct entries


def test_build_prompt_raw_completion():
    task = small()
    sample = next(iter(task.samples()))
    tokenizer = char_tokenizer()
    prompt = task.build_prompt(sample, tokenizer, max_length=None)
    assert "".join(tokenizer.convert_ids_to_tokens(prompt.input_ids)) == "<s>" + sample.fields["prompt"]
    assert prompt.generation.do_sample is False and prompt.generation.max_new_tokens == 20
    assert prompt.info["size"] == 5 and prompt.info["depth"] == sample.fields["query_index"] / 4
    assert prompt.info["exceeds_max_length"] is False
    assert task.build_prompt(sample, tokenizer, max_length=10).info["exceeds_max_length"] is True


@pytest.mark.parametrize(("prediction", "exact", "lenient"), [
    (" 6123456789\nAlice Smith: 7000000000", 1, 1),
    ("  6123456789 \nrest", 1, 1),  # the first line, stripped on both sides
    ("6123456789", 1, 1),
    ("6123456789 is the number", 0, 1),
    ("\n6123456789", 0, 1),
    ("61234567890", 0, 0),
    ("7000000000", 0, 0),
    ("", 0, 0),
])
def test_score_first_line_exact_match(prediction, exact, lenient):
    task = small()
    sample = next(iter(task.samples()))
    sample.fields["answer"] = "6123456789"
    assert task.score(sample, prediction) == {"exact": exact, "lenient": lenient}


def test_summarize_per_size():
    def r(sample_id, exact, lenient=None):
        return {"sample_id": sample_id, "scores": {"exact": exact, "lenient": exact if lenient is None else lenient}}

    rows = [r("n100/b0/q0", 1), r("n100/b1/q0", 1), r("n478/b0/q0", 1), r("n478/b1/q0", 0, 1)]
    summary = small().summarize(rows)
    assert summary["n"] == 4 and summary["exact"] == 0.75 and summary["lenient"] == 1.0
    assert list(summary["by_size"]) == ["100", "478"]
    assert summary["by_size"]["100"] == {"n": 2, "exact": 1.0, "lenient": 1.0, "exact_std_books": 0.0}
    assert summary["by_size"]["478"]["exact"] == 0.5
    assert summary["by_size"]["478"]["exact_std_books"] == pytest.approx(np.std([1, 0], ddof=1))
    with pytest.raises(ValueError, match="n<size>/b<book>/q<query>"):
        small().summarize([r("bad-id", 1)])


def test_validate():
    small().validate()
    with pytest.raises(ValueError, match="queries_per_book.*smallest size \\(5\\)"):
        small(queries_per_book=6).validate()
    with pytest.raises(ValueError, match="sizes"):
        small(sizes=[2, 8]).validate()
    with pytest.raises(ValueError, match="en_US"):
        small(locale="xx_XX").validate()


def test_data_sources_name_the_generator():
    import faker

    sources = small().data_sources()
    [(label, digest)] = sources.items()
    assert faker.VERSION in label and "seed 0" in label and len(digest) == 64
    assert small().data_sources() == sources
    assert list(small(seed=1).data_sources().values()) != [digest]
    assert list(small(sizes=[5, 9]).data_sources().values()) != [digest]


def test_config_instantiates(tmp_path):
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    shutil.copytree(ROOT / "conf" / "task", tmp_path / "task")
    (tmp_path / "config.yaml").write_text("defaults:\n  - task: phonebook\n  - _self_\n")
    with initialize_config_dir(config_dir=str(tmp_path), version_base="1.3"):
        task = instantiate(compose(config_name="config").task)
    assert isinstance(task, Phonebook) and task.name == "phonebook" and task.limit is None
    assert task.sizes == DEFAULT_SIZES and type(task.sizes) is list
    assert (task.books_per_size, task.queries_per_book, task.max_new_tokens) == (5, 1, 20)
    task.validate()
