"""Phonebook lookup: the paper's sizes, per-size summary and configuration errors (offline)."""

from __future__ import annotations

import numpy as np
import pytest

from keydiff.tasks.phonebook import DEFAULT_SIZES, Phonebook

pytestmark = pytest.mark.unit


def small(**overrides) -> Phonebook:
    settings = {"sizes": [5, 8], "books_per_size": 2, "queries_per_book": 2}
    return Phonebook(**{**settings, **overrides})


def test_default_sizes_are_the_papers():
    assert DEFAULT_SIZES == np.round(np.linspace(100, 3500, 10)).astype(int).tolist()
    assert DEFAULT_SIZES[:3] == [100, 478, 856] and DEFAULT_SIZES[-1] == 3500


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


@pytest.mark.parametrize("prediction, exact, lenient", [
    ("  6123456789 \nrest", 1, 1),  # the first line, stripped on both sides
    ("6123456789 is the number", 0, 1),
    ("\n6123456789", 0, 1),
    ("61234567890", 0, 0),
    ("", 0, 0),
])
def test_score_first_line_exact_match(prediction, exact, lenient):
    task = small()
    sample = next(iter(task.samples()))
    sample.fields["answer"] = "6123456789"
    assert task.score(sample, prediction) == {"exact": exact, "lenient": lenient}


def test_limit_covers_sizes_first_and_data_sources_name_the_generator():
    import faker

    limited = list(small(queries_per_book=1, limit=3).samples())
    assert [s.id for s in limited] == ["n5/b0/q0", "n8/b0/q0", "n5/b1/q0"]
    [(label, digest)] = small().data_sources().items()
    assert faker.VERSION in label and "seed 0" in label and len(digest) == 64
    assert list(small(seed=1).data_sources().values()) != [digest]
