"""The LongBench metrics against hand-computed values (arithmetic in the comments), quirks included."""

from __future__ import annotations

import difflib
import math
import random
from functools import partial

import pytest

from keydiff.tasks import longbench_metrics as m
from keydiff.tasks.longbench import aggregate, aggregate_by_length, score_dataset, score_dataset_by_length, score_sample

pytestmark = pytest.mark.unit


def words(n: int) -> str:
    """'w0 w1 ... w{n-1}': n distinct words, no '.'."""
    return " ".join(f"w{i}" for i in range(n))


def close(value: float, tolerance: float = 1e-15):
    return pytest.approx(value, abs=tolerance)


def rouge_f(r: float, p: float):
    """rouge's F = 2PR/(P + R + 1e-8)."""
    return close(2 * p * r / (p + r + 1e-8))


ZH = pytest.mark.extended  # jieba
CLASSES = ["City", "Citybus", "Date"]


@pytest.mark.parametrize("metric, arguments, expected", [
    # lower, drop ASCII punctuation, drop articles, squeeze whitespace; the accent and curly quotes (not ASCII
    # punctuation) stay, and "another" keeps its "an" (the article regex needs \b)
    (m.normalize_answer, ("The  Well-known, Café's  1,000 answer! “Yes” An another",),
     "wellknown cafés 1000 answer “yes” another"),
    # pred -> [cat, sat, on, mat] (4), gold -> [cat, on, mat] (3), common 3: P = 3/4, R = 1, F1 = 1.5/1.75 = 6/7
    (m.qa_f1_score, ("The cat sat on the mat", "a cat on a mat"), close(6 / 7, 1e-12)),
    (m.qa_f1_score, ("go go go", "go"), close(0.5, 1e-12)),  # Counter intersection 1: P = 1/3, R = 1
    (m.qa_f1_score, ("the", "a"), 0),  # both sides normalise to nothing: 0, not 1
    (m.qa_f1_score, ("Paris.", "paris"), 1.0),
    # jieba 0.42.1: "晚上九点。" -> [晚上, 九点, 。]; normalised -> [晚上, 九点, ""]; empty dropped -> [晚上, 九点]
    # gold "九点" -> [九点]; common 1: P = 1/2, R = 1, F1 = 1/(3/2) = 2/3
    pytest.param(m.qa_f1_zh_score, ("晚上九点。", "九点"), close(2 / 3, 1e-12), marks=ZH),
    pytest.param(m.qa_f1_zh_score, ("九点 ！", "九点"), 1.0, marks=ZH),  # one side's punctuation, all whitespace go
    pytest.param(m.qa_f1_zh_score, ("。", "九点"), 0, marks=ZH),
    # The official CJK list holds "》" but not "《"; ASCII punctuation and all whitespace go.
    (m.normalize_zh_answer, ("《青石 镇》, OK!",), "《青石镇ok"),
    # hyp split on '.' -> ["The cat sat on the mat"]; unique hyp words {The, cat, sat, on, the, mat}: n = 6
    # (case-sensitive); ref unique {the, cat, sat, on, mat}: m = 5; LCS "cat sat on the mat" as a set: 5.
    (m.rouge_score, ("The cat sat on the mat.", "the cat sat on the mat"), rouge_f(5 / 5, 5 / 6)),
    (m.rouge_score, ("a b c", "a b c"), close(2 / (2 + 1e-8))),  # exact match: 0.999999995, not 1
    # Summary-level union LCS: hyp sentences c1 = w1 w2 w6 w7 w8, c2 = w1 w3 w8 w9 w5 (n = 8 unique),
    # ref w1..w5 (m = 5): LCS(r,c1) = {w1,w2}, LCS(r,c2) = {w1,w3,w5}, union 4. R = 4/5, P = 4/8
    (m.rouge_score, ("w1 w2 w6 w7 w8. w1 w3 w8 w9 w5", "w1 w2 w3 w4 w5"), rouge_f(4 / 5, 4 / 8)),
    # Punctuation other than '.' stays on the token: hyp {the, "budget,", rose} vs ref {the, budget, rose};
    # LCS {the, rose} = 2; P = R = 2/3
    (m.rouge_score, ("the budget, rose", "the budget rose"), rouge_f(2 / 3, 2 / 3)),
    # Set semantics: ref has m = 1 unique word, hyp n = 2; LCS {trade}: R = 1, P = 1/2
    (m.rouge_score, ("trade deal", "trade trade trade trade"), rouge_f(1, 1 / 2)),
    # "" and "..." leave no sentence: rouge raises ValueError("Hypothesis is empty.") -> 0.0
    (m.rouge_score, ("", "a reference"), 0.0),
    (m.rouge_score, ("...", "a reference"), 0.0),
    # jieba: hyp [会议 决定 把 新 仓库 建在 河 的 东岸 。] (10 unique), ref [会议 决定 在 东岸 建 仓库 。] (7);
    # "。" does not split sentences. LCS length 4 (会议 决定 仓库 。). R = 4/7, P = 4/10
    (m.rouge_zh_score, ("会议决定把新仓库建在河的东岸。", "会议决定在东岸建仓库。"), rouge_f(4 / 7, 4 / 10)),
    # eval.py reaches rouge through rouge_zh_score -> rouge_score, one frame deeper than English: N = 989 works,
    # N = 990 hits the recursion limit -> 0.0. (jieba keeps "w12" as one token; rouge's split drops the spaces.)
    (m.rouge_zh_score, (words(989), "w0"), rouge_f(1, 1 / 989)),
    (m.rouge_zh_score, (words(990), "w0"), 0.0),
    # Removing "Other" while iterating skips "location", which survives: [location, Other location] -> 1/2.
    (partial(m.classification_score, all_classes=["Other", "location", "Other location"]),
     ("Other location", "Other location"), 0.5),
    # "Citybus" contains "City" and "Citybus"; "City" == gold is kept, "Citybus" is not in gold: 1/2
    (partial(m.classification_score, all_classes=CLASSES), ("Citybus", "City"), 0.5),
    (partial(m.classification_score, all_classes=CLASSES), ("city", "City"), 0.0),  # case-sensitive
    (partial(m.classification_score, all_classes=CLASSES), ("Type: Date", "Date"), 1.0),
    (m.retrieval_score, ("Paragraph 12 and Paragraph 3", "Paragraph 3"), 0.5),  # numbers [12, 3]; one is "3"
    (m.retrieval_score, ("Paragraph 012", "Paragraph 12"), 0.0),  # "012" != "12" as strings
    (m.retrieval_score, ("none of them", "Paragraph 12"), 0.0),
    (m.retrieval_zh_score, ("答案是段落3", "段落3"), 1.0),
    (m.retrieval_zh_score, ("段落３", "段落3"), 0.0),  # \d matches the full-width "３", but "３" != "3"
    (m.retrieval_zh_score, ("段落3或段落30", "段落3"), 0.5),  # numbers [3, 30]
    (m.count_score, ("17", "7"), 0.0),  # "17" != "7"
    (m.count_score, ("There are 7 unique paragraphs out of 9", "7"), 0.5),  # [7, 9]
    (m.count_score, ("seven", "7"), 0.0),  # no digits
    (m.count_score, ("7", 7), 1.0),  # gold compared as str(gold)
    # lstrip('\n') then the first line without '`', '#', '//': "```python" and the '#' line are skipped.
    (m.code_sim_score, ("\n\n```python\n    return x  # done\n    return x\n```", "    return x"), 1.0),
    # Leading spaces count: difflib ratio = 2*8/(12+8) = 0.8 -> 80 -> 0.80 (indel: 1 - 4/20 = 0.8 too)
    (m.code_sim_score, ("    return x", "return x"), 0.8),
    (partial(m.code_sim_score, fuzzy_backend="levenshtein"), ("    return x", "return x"), 0.8),
    # The first line has '//' (URL) and is skipped; the second equals the gold.
    (m.code_sim_score, ("url = 'https://example.org'\nreturn url", "return url"), 1.0),
    (m.code_sim_score, ("# comment\n// other", "x = 1"), 0.0),  # no line qualifies: "" against the gold
    (m.code_sim_score, ("# only a comment", ""), 1.0),  # ("", ""): equality is checked before emptiness
    # difflib's autojunk marks "x" popular in the 250-char gold: 0 matches -> 0.
    (partial(m.code_sim_score, fuzzy_backend="difflib"), ("y" + "x" * 249, "x" * 249 + "z"), 0.0),
    # Indel distance 2 (delete "y", insert "z"): 1 - 2/500 -> 99.6 -> 100 -> 1.0.
    (partial(m.code_sim_score, fuzzy_backend="levenshtein"), ("y" + "x" * 249, "x" * 249 + "z"), 1.0),
    (m.fuzz_ratio, ("a", "a" + "b" * 14), 12),  # 1 matching char, 2*1/16 = 0.125 -> 12.5 -> round() = 12
    (m.fuzz_ratio, ("aaa", "aaa" + "b" * 13), 32),  # 3 matching chars of 3 + 16: 6/19 = 0.3158 -> 31.58 -> 32
    (m.fuzz_ratio, (None, "x"), 0),
    (m.fuzz_ratio, ("x", ""), 0),
    (m.fuzz_ratio, ("", ""), 100),
    # trec: lstrip('\n') -> "City\nType: Date" -> first line "City" -> matches [City] -> 1.0
    (score_sample, ("trec", "\n\nCity\nType: Date", ["City"], ["City", "Date"]), 1.0),
    (score_sample, ("triviaqa", " \nKessel Quay", ["Kessel Quay"]), 0.0),  # only '\n' stripped: the line " "
    # No cut for hotpotqa: pred [kessel, quay, x] vs gold [kessel, quay]: P = 2/3, R = 1, F1 = 0.8
    (score_sample, ("hotpotqa", "Kessel Quay\nx", ["Kessel Quay"]), close(0.8, 1e-12)),
    (score_sample, ("samsum", "a b c\nmore text", ["a b c"]), close(2 / (2 + 1e-8))),  # the first line only
    # "box" vs "a tin box" -> [box] vs [tin, box]: P = 1, R = 1/2, F1 = 2/3; vs "box" -> 1.0; the max counts
    (score_sample, ("triviaqa", "box", ["a tin box", "box"]), 1.0),
    (score_sample, ("triviaqa", "box", ["a tin box"]), close(2 / 3, 1e-12)),
    # 1 right of 32: 100 * 1.0 / 32 = 3.125 -> round(3.125, 2) = 3.12 (half-even; 3.125 is exact)
    (score_dataset, ("passage_count", ["7"] + ["1"] * 31, [["7"]] * 32), 3.12),
    (score_dataset, ("passage_count", ["7", "1", "1"], [["7"]] * 3), 33.33),  # 33.333... -> 33.33
    (aggregate, ([1.0, 0.5],), 75.0),
    # 3999 -> 0-4k; 4000 and 7999 -> 4-8k; 8000 -> 8k+. Scores 1, 0, 1, 0.
    (score_dataset_by_length, ("passage_count", ["7", "1", "7", "1"], [["7"]] * 4, [3999, 4000, 7999, 8000]),
     {"0-4k": 100.0, "4-8k": 50.0, "8k+": 0.0}),
])
def test_official_metric_values(metric, arguments, expected):
    assert metric(*arguments) == expected


def test_rouge_score_recursion_error_threshold_matches_official_eval_at_any_caller_depth():
    # ref "w0" against N distinct words: _recon_lcs nests N + 1 calls above eval.py's 9 frames, so N = 990
    # (depth 1000) works and N = 991 hits CPython's limit: RecursionError -> 0.0, as in `python eval.py`.
    def deep(k: int) -> tuple[float, float]:
        return deep(k - 1) if k else (m.rouge_score(words(990), "w0"), m.rouge_score(words(991), "w0"))

    for ok, failed in (deep(0), deep(300)):
        assert ok == rouge_f(1, 1 / 990) and failed == 0.0  # N = 990: m = 1, n = 990, LCS 1: R = 1, P = 1/990


def test_what_the_official_code_raises_is_raised_and_an_empty_bucket_is_nan():
    with pytest.raises(IndexError):  # gold without "Paragraph N": the official code raises too
        m.retrieval_score("1", "no id")
    with pytest.raises(ValueError):
        aggregate([])
    scores = aggregate_by_length([1.0, 0.0], [100, 200])  # an empty bucket is NaN, as np.mean([]) officially
    assert scores["0-4k"] == 50.0 and math.isnan(scores["4-8k"]) and math.isnan(scores["8k+"])


def test_difflib_backend_equals_fuzzywuzzy_without_levenshtein(monkeypatch):
    from fuzzywuzzy import fuzz

    # What fuzzywuzzy computes when python-Levenshtein is absent (the official requirements.txt).
    monkeypatch.setattr(fuzz, "SequenceMatcher", difflib.SequenceMatcher)
    rng = random.Random(0)
    alphabet = "abc xyz()=#_.\t"
    for _ in range(300):
        a = "".join(rng.choice(alphabet) for _ in range(rng.choice([0, 5, 30, 210])))
        b = "".join(c if rng.random() < 0.8 else rng.choice(alphabet) for c in a) + rng.choice(["", "q", "  "])
        assert m.fuzz_ratio(a, b, "difflib") == fuzz.ratio(a, b)


def test_levenshtein_backend_equals_python_levenshtein():
    import Levenshtein as levenshtein  # in the dev extra
    rng = random.Random(1)
    for _ in range(300):
        a = "".join(rng.choice("abcd ") for _ in range(rng.randint(1, 40)))
        b = "".join(rng.choice("abcd ") for _ in range(rng.randint(1, 40)))
        assert m.fuzz_ratio(a, b, "levenshtein") == int(round(100 * levenshtein.ratio(a, b)))
    from fuzzywuzzy import fuzz

    assert fuzz.SequenceMatcher is not difflib.SequenceMatcher  # fuzzywuzzy picked python-Levenshtein up
    for a, b in [("    return x", "return x"), ("y" + "x" * 249, "x" * 249 + "z"), ("", ""), ("a", "")]:
        assert m.fuzz_ratio(a, b, "levenshtein") == fuzz.ratio(a, b)


def test_unknown_names_are_refused_naming_the_valid_ones():
    with pytest.raises(ValueError, match="difflib, levenshtein"):
        m.code_sim_score("a", "b", fuzzy_backend="thefuzz")
    with pytest.raises(ValueError, match="narrativeqa"):
        score_sample("narrative_qa", "x", ["x"])
    with pytest.raises(ValueError, match="all_classes"):
        score_sample("trec", "City", ["City"])
    assert m.fuzzy_backend_description("difflib").startswith("difflib")
    assert m.metric_environment("levenshtein")["fuzzy_backend"] == "levenshtein"
