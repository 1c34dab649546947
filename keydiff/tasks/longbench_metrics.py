"""The LongBench v1 metrics, behaving exactly like the official `LongBench/metrics.py`, quirks included
(published numbers come from it). Design: docs/design/tasks.md#longbench
"""

from __future__ import annotations

import difflib
import re
import string
import sys
import threading
from collections import Counter
from importlib.metadata import version
from typing import Any, Callable

import jieba
from rapidfuzz.distance import Indel
from rouge import Rouge

FUZZY_BACKENDS = ("difflib", "levenshtein")

# CJK punctuation removed by the official `normalize_zh_answer` (verbatim; note `《` is absent, `》` present).
_CN_PUNCTUATION = (
    "！？｡。＂＃＄％＆＇（）＊＋，－／：；＜＝＞＠［＼］＾＿｀｛｜｝～｟｠｢｣､、〃》「」『』【】〔〕〖〗〘〙〚〛〜〝〞〟〰〾〿–—‘’‛“”„‟…‧﹏."
)
_ASCII_PUNCTUATION = frozenset(string.punctuation)
_ZH_PUNCTUATION = frozenset(string.punctuation + _CN_PUNCTUATION)

# Python frames above `Rouge.get_scores` when the official `python eval.py` scores a sample:
# <module> -> scorer -> rouge_score (English), and one more, rouge_zh_score, for Chinese.
_OFFICIAL_FRAMES_EN = 3
_OFFICIAL_FRAMES_ZH = 4
_OFFICIAL_RECURSION_LIMIT = 1000  # CPython's default, which the official script never changes




def normalize_answer(s: str) -> str:
    """Lower-case, drop ASCII punctuation, replace the articles a/an/the by a space, collapse whitespace."""
    text = s.lower()
    text = "".join(ch for ch in text if ch not in _ASCII_PUNCTUATION)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def normalize_zh_answer(s: str) -> str:
    """Lower-case, drop ASCII and CJK punctuation, and remove all whitespace (no article handling)."""
    text = s.lower()
    text = "".join(ch for ch in text if ch not in _ZH_PUNCTUATION)
    return "".join(text.split())


def f1_score(prediction_tokens: list[str], ground_truth_tokens: list[str]) -> float:
    """Bag-of-tokens F1. No common token gives 0 (also when both sides are empty)."""
    common = Counter(prediction_tokens) & Counter(ground_truth_tokens)
    num_same = sum(common.values())
    if num_same == 0:
        return 0
    precision = 1.0 * num_same / len(prediction_tokens)
    recall = 1.0 * num_same / len(ground_truth_tokens)
    return (2 * precision * recall) / (precision + recall)


def qa_f1_score(prediction: str, ground_truth: str, **_: Any) -> float:
    """English token F1 after `normalize_answer`."""
    return f1_score(normalize_answer(prediction).split(), normalize_answer(ground_truth).split())


def _jieba_tokens(text: str) -> list[str]:
    return list(jieba.cut(text, cut_all=False))


def qa_f1_zh_score(prediction: str, ground_truth: str, **_: Any) -> float:
    """Chinese token F1: jieba on the raw strings, then `normalize_zh_answer` per token, empty tokens dropped."""
    prediction_tokens = [normalize_zh_answer(t) for t in _jieba_tokens(prediction)]
    ground_truth_tokens = [normalize_zh_answer(t) for t in _jieba_tokens(ground_truth)]
    return f1_score([t for t in prediction_tokens if t], [t for t in ground_truth_tokens if t])




class _OfficialStackThread(threading.Thread):
    """Runs `Rouge().get_scores` with exactly `frames_above` Python frames below it on a fresh stack, so the
    recursion limit bites at the same sentence lengths as in the official script."""

    def __init__(self, hypothesis: str, reference: str, frames_above: int) -> None:
        super().__init__(name="longbench-rouge", daemon=True)
        self.hypothesis = hypothesis
        self.reference = reference
        # A raised recursion limit would let longer sentences through; pad it away.
        self.frames_above = frames_above + sys.getrecursionlimit() - _OFFICIAL_RECURSION_LIMIT
        self.value: float | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        depth = _stack_depth()
        if depth < self.frames_above:
            self.run()
            return
        if depth > self.frames_above:  # cannot happen on CPython 3.10-3.13 (3 threading frames)
            self.error = RuntimeError(
                f"cannot reproduce the official stack depth {self.frames_above}: a fresh thread "
                f"already has {depth} frames"
            )
            return
        try:
            self.value = Rouge().get_scores([self.hypothesis], [self.reference], avg=True)["rouge-l"]["f"]
        except Exception:  # official: bare `except: return 0.0` (ValueError, RecursionError, ...)
            self.value = 0.0


def _stack_depth() -> int:
    depth, frame = 0, sys._getframe(1)
    while frame is not None:
        depth, frame = depth + 1, frame.f_back
    return depth


def _rouge_l_f(hypothesis: str, reference: str, frames_above: int) -> float:
    worker = _OfficialStackThread(hypothesis, reference, frames_above)
    worker.start()
    worker.join()
    if worker.error is not None:
        raise worker.error
    assert worker.value is not None
    return worker.value


def rouge_score(prediction: str, ground_truth: str, **_: Any) -> float:
    """ROUGE-L F of the `rouge` 1.0.1 package; any exception (empty text, RecursionError) gives 0.0."""
    return _rouge_l_f(prediction, ground_truth, _OFFICIAL_FRAMES_EN)


def rouge_zh_score(prediction: str, ground_truth: str, **_: Any) -> float:
    """`rouge_score` on jieba tokens joined by spaces (no lower-casing, punctuation kept)."""
    prediction = " ".join(_jieba_tokens(prediction))
    ground_truth = " ".join(_jieba_tokens(ground_truth))
    return _rouge_l_f(prediction, ground_truth, _OFFICIAL_FRAMES_ZH)




def classification_score(prediction: str, ground_truth: str, *, all_classes: list[str], **_: Any) -> float:
    """1/len(matches) if the gold class is among the classes found (as substrings) in the prediction. Classes that
    are substrings of the gold are meant to be dropped, but the official loop removes from the list it iterates,
    skipping the item after each removal: reproduced literally."""
    em_match_list = [class_name for class_name in all_classes if class_name in prediction]
    for match_term in em_match_list:  # mutating while iterating: the skip is intended (official)
        if match_term in ground_truth and match_term != ground_truth:
            em_match_list.remove(match_term)
    if ground_truth in em_match_list:
        return 1.0 / len(em_match_list)
    return 0.0


def _share_equal(numbers: list[str], target: str) -> float:
    if not numbers:
        return 0.0
    return float(sum(1 for number in numbers if number == target) / len(numbers))


def retrieval_score(prediction: str, ground_truth: str, **_: Any) -> float:
    """Share of the digit runs in the prediction equal to N of the gold "Paragraph N" (string equality)."""
    ground_truth_id = re.findall(r"Paragraph (\d+)", ground_truth)[0]
    return _share_equal(re.findall(r"\d+", prediction), str(ground_truth_id))


def retrieval_zh_score(prediction: str, ground_truth: str, **_: Any) -> float:
    """As `retrieval_score` with the gold pattern "段落N"."""
    ground_truth_id = re.findall(r"段落(\d+)", ground_truth)[0]
    return _share_equal(re.findall(r"\d+", prediction), str(ground_truth_id))


def count_score(prediction: str, ground_truth: str, **_: Any) -> float:
    """Share of the digit runs in the prediction equal to the gold count (string equality)."""
    return _share_equal(re.findall(r"\d+", prediction), str(ground_truth))




def _difflib_ratio(s1: str, s2: str) -> float:
    # difflib's default autojunk=True, as fuzzywuzzy constructs it.
    return difflib.SequenceMatcher(None, s1, s2).ratio()


_RATIO_FUNCTIONS: dict[str, Callable[[str, str], float]] = {
    "difflib": _difflib_ratio,
    "levenshtein": Indel.normalized_similarity,  # == python-Levenshtein's Levenshtein.ratio
}


def check_fuzzy_backend(backend: str) -> None:
    """Raise ValueError naming the valid backends."""
    if backend not in FUZZY_BACKENDS:
        raise ValueError(f"unknown fuzzy backend {backend!r}; valid backends: {', '.join(FUZZY_BACKENDS)}")


def fuzz_ratio(s1: str | None, s2: str | None, backend: str = "difflib") -> int:
    """fuzzywuzzy 0.18.0 `fuzz.ratio`: None -> 0, equal -> 100 (so ("", "") -> 100), an empty side -> 0,
    else round(100 * ratio) with Python's half-even `round`."""
    check_fuzzy_backend(backend)
    if s1 is None or s2 is None:
        return 0
    if s1 == s2:
        return 100
    if len(s1) == 0 or len(s2) == 0:
        return 0
    return int(round(100 * _RATIO_FUNCTIONS[backend](s1, s2)))


def code_sim_score(prediction: str, ground_truth: str, *, fuzzy_backend: str = "difflib", **_: Any) -> float:
    """fuzz.ratio/100 between the gold line and the first predicted line free of '`', '#' and '//'."""
    candidate = ""
    for line in prediction.lstrip("\n").split("\n"):
        if "`" not in line and "#" not in line and "//" not in line:
            candidate = line
            break
    return fuzz_ratio(candidate, ground_truth, fuzzy_backend) / 100


def fuzzy_backend_description(backend: str) -> str:
    """A string naming the backend and the package versions it runs on, for the run's metadata."""
    check_fuzzy_backend(backend)
    if backend == "difflib":
        return (
            f"difflib (python {sys.version.split()[0]} difflib.SequenceMatcher, autojunk=True; "
            "= fuzzywuzzy 0.18.0 without python-Levenshtein, the official LongBench setup)"
        )
    return (
        f"levenshtein (rapidfuzz {version('rapidfuzz')} Indel.normalized_similarity; "
        "= fuzzywuzzy 0.18.0 with python-Levenshtein>=0.20 installed)"
    )


def metric_environment(fuzzy_backend: str) -> dict[str, str]:
    """Versions of everything that can change a LongBench score, for the run's metadata."""
    return {
        "rouge": version("rouge"),
        "jieba": version("jieba"),
        "fuzzy_backend": fuzzy_backend,
        "fuzzy_backend_detail": fuzzy_backend_description(fuzzy_backend),
        "python": sys.version.split()[0],
    }
