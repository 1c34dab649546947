"""Needle-in-a-Haystack: per (context length, depth), a needle inserted gkamradt-style, scored by `needle_recall`.

Design: docs/design/tasks.md#needle-in-a-haystack
"""

from __future__ import annotations

import math
import string
import unicodedata
from dataclasses import dataclass, field
from typing import Any, ClassVar, Iterator

from keydiff.tasks.base import GenerationSettings, Prompt, Sample, Task, encode_user_turn, split_encode
from keydiff.tasks.haystack import Haystack, check_source, load_haystack

NEEDLE = "\nThe best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day.\n"
QUESTION = "What is the best thing to do in San Francisco?"
ANSWER = "eat a sandwich and sit in Dolores Park on a sunny day."
GKAMRADT_SYSTEM = "You are a helpful AI bot that answers questions for a user. Keep your response short and direct"
GKAMRADT_QUESTION_SUFFIX = " Don't give information outside the document or repeat your findings"

PROMPT_STYLES = ("storybook", "gkamradt")
RECALL_COMPAT = ("normalized", "kvcache-factory")


def paper_context_lengths() -> list[int]:
    """KeyDiff Table 18 lengths: np.round(np.linspace(1000, 30000, 10))."""
    import numpy as np

    return [int(x) for x in np.round(np.linspace(1000, 30000, 10))]


def paper_depths() -> list[int]:
    """KeyDiff Table 18 depths: np.round(np.linspace(0, 100, 10))."""
    import numpy as np

    return [int(x) for x in np.round(np.linspace(0, 100, 10))]


def normalize_words(text: str) -> list[str]:
    """Lowercase, every punctuation character (ASCII or Unicode) replaced by a space, split on whitespace."""
    chars = [
        " " if ch in string.punctuation or unicodedata.category(ch).startswith("P") else ch for ch in text.lower()
    ]
    return "".join(chars).split()


def needle_recall(prediction: str, answer: str = ANSWER, compat: str = "normalized") -> float:
    """Set recall of the answer's words in the prediction (see the module docstring)."""
    if compat == "kvcache-factory":
        expected = set(answer.lower().split())
        got = set(prediction.lower().split())
    elif compat == "normalized":
        expected = set(normalize_words(answer))
        got = set(normalize_words(prediction))
    else:
        raise ValueError(f"recall_compat={compat!r} is not valid; choose one of {list(RECALL_COMPAT)}")
    if not expected:
        raise ValueError("the answer has no words")
    return len(expected & got) / len(expected)


def rouge1_scores(prediction: str, reference: str) -> tuple[float, float]:
    """(ROUGE-1 F, ROUGE-1 recall of `reference`) with the `rouge` 1.0.1 package; 0 for an empty prediction."""
    from rouge import Rouge

    prediction, reference = prediction.strip(), reference.strip()
    # rouge raises on a hypothesis that has no sentence left after its "." split.
    if not prediction or not [s for s in prediction.split(".") if s.strip()]:
        return 0.0, 0.0
    scores = Rouge(metrics=["rouge-1"]).get_scores(prediction, reference)[0]["rouge-1"]
    return float(scores["f"]), float(scores["r"])


def period_token_ids(tokenizer: Any) -> frozenset[int]:
    """Ids of every non-special vocabulary token whose decoded text, right-stripped, ends with "."."""
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    for token_id, added in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(added, "special", False):
            special.add(int(token_id))
    size = len(tokenizer)
    texts = tokenizer.batch_decode([[i] for i in range(size)])
    return frozenset(i for i, text in enumerate(texts) if i not in special and text.rstrip().endswith("."))


@dataclass
class NeedleInAHaystack(Task):
    name: str = "niah"
    context_lengths: list[int] = field(default_factory=paper_context_lengths)
    depths: list[int] = field(default_factory=paper_depths)
    # Folder of .txt files (sorted, repeated until long enough); None: the default haystack of `haystack_source`,
    # "pinned" (the repository's prose of CPython 3.11.7's pydoc_data/topics.py, the same on every Python) or
    # "interpreter" (the running interpreter's pydoc_data/topics.py, which differs between Python builds).
    haystack_dir: str | None = None
    haystack_source: str = "pinned"
    prompt_style: str = "storybook"
    chat: bool = True
    recall_compat: str = "normalized"
    buffer: int = 200
    max_new_tokens: int = 50
    needle: str = NEEDLE
    question: str = QUESTION
    answer: str = ANSWER
    limit: int | None = None

    _haystack: Haystack | None = field(default=None, init=False, repr=False, compare=False)
    _tokenizer: Any = field(default=None, init=False, repr=False, compare=False)
    _haystack_ids: list[int] | None = field(default=None, init=False, repr=False, compare=False)
    _period_ids: frozenset[int] | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Hydra hands over ListConfig objects; keep plain lists of ints (validate() reports bad values).
        self.context_lengths = [_as_int(v) for v in self.context_lengths]
        self.depths = [_as_int(v) for v in self.depths]

    def validate(self) -> None:
        if not self.context_lengths:
            raise ValueError("niah.context_lengths must list at least one context length")
        if not self.depths:
            raise ValueError("niah.depths must list at least one depth")
        for length in self.context_lengths:
            if not isinstance(length, int) or length <= self.buffer:
                raise ValueError(
                    f"niah.context_lengths entries must be integers larger than buffer={self.buffer}, got {length!r}"
                )
        for depth in self.depths:
            if not isinstance(depth, int) or not 0 <= depth <= 100:
                raise ValueError(f"niah.depths entries must be integers in [0, 100], got {depth!r}")
        if len(set(self.context_lengths)) != len(self.context_lengths) or len(set(self.depths)) != len(self.depths):
            raise ValueError("niah.context_lengths and niah.depths must not repeat values (sample ids must be unique)")
        if self.prompt_style not in PROMPT_STYLES:
            raise ValueError(f"niah.prompt_style={self.prompt_style!r} is not valid; choose one of {list(PROMPT_STYLES)}")
        if self.recall_compat not in RECALL_COMPAT:
            raise ValueError(f"niah.recall_compat={self.recall_compat!r} is not valid; choose one of {list(RECALL_COMPAT)}")
        if isinstance(self.buffer, bool) or not isinstance(self.buffer, int) or self.buffer < 0:
            raise ValueError(f"niah.buffer must be a non-negative integer, got {self.buffer!r}")
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) or self.max_new_tokens <= 0:
            raise ValueError(f"niah.max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
        if self.limit is not None and (isinstance(self.limit, bool) or not isinstance(self.limit, int) or self.limit < 0):
            raise ValueError(f"niah.limit must be null or a non-negative integer, got {self.limit!r}")
        if not self.needle.strip() or not self.question.strip() or not normalize_words(self.answer):
            raise ValueError("niah.needle, niah.question and niah.answer must be non-empty")
        check_source(self.haystack_source)
        if self.haystack_dir is not None:
            from pathlib import Path

            folder = Path(self.haystack_dir).expanduser()
            if not folder.is_dir():
                raise ValueError(f"niah.haystack_dir={self.haystack_dir!r} is not a directory")
            if not any(p.suffix == ".txt" and p.is_file() for p in folder.iterdir()):
                raise ValueError(f"niah.haystack_dir={self.haystack_dir!r} contains no .txt files")

    def check_model(self, max_length: int | None) -> None:
        too_long = [length for length in self.context_lengths if max_length is not None and length > max_length]
        if too_long:
            raise ValueError(
                f"niah.context_lengths {too_long} exceed the model's max_length ({max_length}); drop them "
                f"(e.g. task.context_lengths=[...]) or use a model with a longer context"
            )

    def haystack(self) -> Haystack:
        if self._haystack is None:
            self._haystack = load_haystack(self.haystack_dir, self.haystack_source)
        return self._haystack

    def data_sources(self) -> dict[str, str]:
        return dict(self.haystack().sources)

    def samples(self) -> Iterator[Sample]:
        count = 0
        for length in self.context_lengths:
            for depth in self.depths:
                if self.limit is not None and count >= self.limit:
                    return
                count += 1
                yield Sample(id=f"L{length}/d{depth}", fields={"context_length": length, "depth": depth})

    def _prepare(self, tokenizer: Any) -> None:
        """Tokenize the haystack (repeated to the longest context) and find the period tokens, once per tokenizer."""
        if self._tokenizer is tokenizer:
            return
        text = self.haystack().text
        needed = max(self.context_lengths)
        ids = _encode(tokenizer, text)
        if not ids:
            raise ValueError("the haystack encodes to no tokens")
        if len(ids) < needed:
            ids = _encode(tokenizer, text * math.ceil(needed / len(ids) + 1))
        self._haystack_ids = ids
        self._period_ids = period_token_ids(tokenizer)
        self._tokenizer = tokenizer

    def insert_needle(self, tokenizer: Any, context_length: int, depth: int) -> dict[str, Any]:
        """Token-level needle insertion (gkamradt `insert_needle`). Returns ids, text and positions."""
        self._prepare(tokenizer)
        assert self._haystack_ids is not None and self._period_ids is not None
        needle_ids = _encode(tokenizer, self.needle)
        budget = context_length - self.buffer
        keep = budget - len(needle_ids)
        if keep <= 0:
            raise ValueError(
                f"context length {context_length} leaves no room for the haystack "
                f"(buffer {self.buffer} + needle {len(needle_ids)} tokens)"
            )
        context = self._haystack_ids[: min(context_length, keep)]
        if depth >= 100:
            point = len(context)
        else:
            point = int(len(context) * depth / 100)
            while point > 0 and context[point - 1] not in self._period_ids:
                point -= 1
        ids = context[:point] + needle_ids + context[point:]
        text = tokenizer.decode(ids)
        before = tokenizer.decode(context[:point]) if point else ""
        core = self.needle.strip()
        char_start = text.find(core, max(0, len(before) - len(core)))
        if char_start < 0:
            char_start = text.find(core)
        return {
            "ids": ids,
            "text": text,
            "insertion_token": point,
            "context_tokens": len(context),
            "needle_tokens": len(needle_ids),
            "realised_depth": 100.0 * point / len(context) if context else 0.0,
            "needle_char_start": char_start,
        }

    context_split: ClassVar[str | None] = ("the retrieval question: storybook, before \"Based on the content of the "
                                           "book, Question:\"; gkamradt, before the question's user message")

    def build_prompt(self, sample: Sample, tokenizer: Any, max_length: int | None, query_aware: bool = True) -> Prompt:
        length = int(sample.fields["context_length"])
        depth = int(sample.fields["depth"])
        if max_length is not None and length > max_length:
            raise ValueError(
                f"NIAH context length {length} exceeds the model's max_length {max_length}; "
                "drop it from task.context_lengths or use a model with a larger max_length"
            )
        made = self.insert_needle(tokenizer, length, depth)
        haystack = made["text"]

        if self.prompt_style == "storybook":
            context = f"This is a very long story book: <book> {haystack} </book>.\n"
            question = f"Based on the content of the book, Question: {self.question}\nAnswer:"
            text = context + question
            input_ids = encode_user_turn(tokenizer, text, chat=self.chat)
            rendered, add_special = _render_user_turn(tokenizer, text, self.chat)
            offset = rendered.find(text)
            if offset < 0 or made["needle_char_start"] < 0:  # the template rewrote the text
                needle_pos = question_pos = -1
            else:
                needle_pos = offset + len("This is a very long story book: <book> ") + made["needle_char_start"]
                question_pos = offset + len(context)
        else:
            question = self.question + GKAMRADT_QUESTION_SUFFIX
            rendered, add_special = _render_gkamradt(tokenizer, haystack, question, self.chat)
            input_ids = list(tokenizer(rendered, add_special_tokens=add_special)["input_ids"])
            start = rendered.find(haystack)
            if start < 0 or made["needle_char_start"] < 0:
                needle_pos = question_pos = -1
            else:
                needle_pos = start + made["needle_char_start"]
                question_pos = rendered.find(question, start + len(haystack))

        context_tokens = None
        if not query_aware:  # kvpress's tokenisation: the context and the question encoded apart
            if question_pos < 0:
                raise ValueError("NIAH: the chat template rewrote the prompt, so the question cannot be split from the "
                                 "context (query_aware=false); use query_aware=true or task.chat=false")
            input_ids, context_tokens = split_encode(tokenizer, rendered, question_pos, add_special)
        needle_index = question_index = None
        spans = _token_spans(tokenizer, rendered, add_special)
        if spans is not None and len(spans) == len(input_ids):
            needle_index = _token_at(spans, needle_pos) if needle_pos >= 0 else None
            question_index = _token_at(spans, question_pos) if question_pos >= 0 else None
        if context_tokens is not None:
            question_index = context_tokens

        info = {
            "context_length": length,
            "depth": depth,
            "realised_depth": round(made["realised_depth"], 3),
            "needle_token_index": needle_index,
            "question_token_index": question_index,
            "insertion_token": made["insertion_token"],
            "haystack_tokens": made["context_tokens"] + made["needle_tokens"],
            "prompt_tokens": len(input_ids),
            "prompt_style": self.prompt_style,
        }
        settings = GenerationSettings(max_new_tokens=self.max_new_tokens, do_sample=False)
        return Prompt(input_ids=input_ids, generation=settings, info=info, context_tokens=context_tokens)

    def score(self, sample: Sample, prediction: str) -> dict[str, float]:
        recall = needle_recall(prediction, self.answer, self.recall_compat)
        rouge_f, rouge_r = rouge1_scores(prediction, self.needle)
        return {
            "needle_recall": recall,
            "accuracy": 1.0 if recall == 1.0 else 0.0,
            "rouge1": rouge_f,
            "rouge1_recall": rouge_r,
        }

    def summarize(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        """Means of every score, plus per-cell tables for heatmaps: ``<score>_by_cell[str(length)][str(depth)]``
        (string keys survive JSON) and the marginal ``needle_recall_by_length`` / ``needle_recall_by_depth``."""
        summary: dict[str, Any] = dict(super().summarize(rows))
        summary["n"] = len(rows)
        cells: dict[str, dict[str, dict[str, list[float]]]] = {}
        for row in rows:
            length, depth = _cell_of(row)
            for key in ("needle_recall", "accuracy"):
                if key in row.get("scores", {}):
                    cells.setdefault(key, {}).setdefault(str(length), {}).setdefault(str(depth), []).append(
                        float(row["scores"][key])
                    )
        for key, table in cells.items():
            summary[f"{key}_by_cell"] = {
                length: {depth: sum(v) / len(v) for depth, v in by_depth.items()} for length, by_depth in table.items()
            }
        recall = cells.get("needle_recall", {})
        by_length = {length: [x for v in by_depth.values() for x in v] for length, by_depth in recall.items()}
        by_depth_lists: dict[str, list[float]] = {}
        for by_depth in recall.values():
            for depth, values in by_depth.items():
                by_depth_lists.setdefault(depth, []).extend(values)
        summary["needle_recall_by_length"] = {k: sum(v) / len(v) for k, v in by_length.items()}
        summary["needle_recall_by_depth"] = {k: sum(v) / len(v) for k, v in by_depth_lists.items()}
        return summary


def _as_int(value: Any) -> Any:
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _render_user_turn(tokenizer: Any, text: str, chat: bool) -> tuple[str, bool]:
    """The string (and add_special_tokens flag) that `encode_user_turn` tokenizes."""
    if chat and getattr(tokenizer, "chat_template", None):
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
        )
        return rendered, False
    return text, True


def _render_gkamradt(tokenizer: Any, haystack: str, question: str, chat: bool) -> tuple[str, bool]:
    if chat and getattr(tokenizer, "chat_template", None):
        messages = [
            {"role": "system", "content": GKAMRADT_SYSTEM},
            {"role": "user", "content": haystack},
            {"role": "user", "content": question},
        ]
        try:
            rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception:  # templates that insist on alternating roles
            merged = messages[:1] + [{"role": "user", "content": f"{haystack}\n\n{question}"}]
            rendered = tokenizer.apply_chat_template(merged, tokenize=False, add_generation_prompt=True)
        return rendered, False
    return f"{GKAMRADT_SYSTEM}\n\n{haystack}\n\n{question}", True


def _token_spans(tokenizer: Any, text: str, add_special: bool) -> list[tuple[int, int]] | None:
    try:
        encoded = tokenizer(text, add_special_tokens=add_special, return_offsets_mapping=True)
    except (NotImplementedError, ValueError, TypeError):  # slow tokenizers have no offsets
        return None
    return [tuple(span) for span in encoded["offset_mapping"]]


def _token_at(spans: list[tuple[int, int]], position: int) -> int | None:
    """Index of the first token that ends after character `position`."""
    for index, (start, end) in enumerate(spans):
        if end > position and end > start:
            return index
    return None


def _cell_of(row: dict[str, Any]) -> tuple[int, int]:
    info = row.get("info") or {}
    if "context_length" in info and "depth" in info:
        return int(info["context_length"]), int(info["depth"])
    length, depth = str(row["sample_id"]).split("/")
    return int(length.lstrip("L")), int(depth.lstrip("d"))
