"""Phonebook lookup (Jelassi et al. 2024, "Repeat After Me"), as in KeyDiff Appendix H.1 / Table 17.

Design: docs/design/tasks.md#phonebook
"""

from __future__ import annotations

import functools
import hashlib
import json
import random
import re
import statistics
from dataclasses import dataclass, field
from typing import Any, ClassVar, Iterator

import faker
from faker.config import AVAILABLE_LOCALES

from keydiff.tasks.base import (GenerationSettings, Prompt, Sample, Task, encode_user_turn, locate, render_user_turn,
                                 split_encode)

DEFAULT_SIZES = [100, 478, 856, 1233, 1611, 1989, 2367, 2744, 3122, 3500]
# Bump when a change in this module changes the generated books.
GENERATOR_VERSION = 1
_SAMPLE_ID = re.compile(r"^n(\d+)/b(\d+)/q(\d+)$")
_PHONE = re.compile(r"(?<!\d)\d{10}(?!\d)")


def book_seed(seed: int, size: int, book: int) -> int:
    """Seed of one book, stable across machines and independent of the other books."""
    digest = hashlib.sha256(f"phonebook|{seed}|{size}|{book}".encode()).digest()
    return int.from_bytes(digest[:8], "big")


@functools.lru_cache(maxsize=None)
def _faker(locale: str) -> faker.Faker:
    return faker.Faker(locale)


def generate_book(size: int, seed: int, locale: str = "en_US") -> list[tuple[str, str]]:
    """`size` (name, phone) pairs with unique full names (Faker's first + last name for `locale`) and unique
    10-digit phone numbers whose first digit is 6-9 (the original format), drawn from `random.Random(seed)`."""
    fake = _faker(locale)
    fake.seed_instance(seed)
    rng = random.Random(seed)
    names: dict[str, None] = {}  # insertion-ordered set
    attempts = 0
    while len(names) < size:
        attempts += 1
        if attempts > 50 * size:
            raise ValueError(f"Faker locale {locale!r} cannot give {size} unique names; use a smaller size")
        names.setdefault(f"{fake.first_name()} {fake.last_name()}", None)
    phones: dict[str, None] = {}
    while len(phones) < size:
        phones.setdefault(str(rng.randint(6, 9)) + "".join(str(rng.randint(0, 9)) for _ in range(9)), None)
    return list(zip(names, phones))


def format_entry(name: str, phone: str) -> str:
    return f"{name}: {phone}"


def build_prompt_text(book: list[tuple[str, str]], query: int, fewshot: tuple[int, int]) -> str:
    """The Jelassi prompt: book, blank line, two few-shot entries, blank line, `"{query name}:"`."""
    context = "\n".join(format_entry(name, phone) for name, phone in book)
    shots = "\n".join(format_entry(*book[i]) for i in fewshot)
    return f"{context}\n\n{shots}\n\n{book[query][0]}:"


def first_line(prediction: str) -> str:
    """The answer the original scorer reads: the first line of the output, stripped."""
    return prediction.split("\n")[0].strip()


@dataclass
class Phonebook(Task):
    """Synthetic phonebook lookup over `sizes` x `books_per_size` books x `queries_per_book` queries. Samples come
    book-major, so `limit` still covers every size; prompts are never truncated (that would cut the answer)."""

    name: str = "phonebook"
    limit: int | None = None
    sizes: list[int] = field(default_factory=lambda: list(DEFAULT_SIZES))
    books_per_size: int = 5
    queries_per_book: int = 1
    seed: int = 0
    locale: str = "en_US"
    max_new_tokens: int = 20
    chat_template: bool = False

    def __post_init__(self) -> None:
        self.sizes = [int(size) for size in self.sizes]  # Hydra hands over a ListConfig

    def validate(self) -> None:
        if not self.sizes or min(self.sizes) < 3:
            raise ValueError(f"task.sizes must be a non-empty list of book sizes >= 3, got {self.sizes}")
        if len(set(self.sizes)) != len(self.sizes):
            raise ValueError(f"task.sizes has repeated values: {self.sizes}")
        if self.books_per_size < 1:
            raise ValueError(f"task.books_per_size must be >= 1, got {self.books_per_size}")
        if not 1 <= self.queries_per_book <= min(self.sizes):
            raise ValueError(
                f"task.queries_per_book must be between 1 and the smallest size ({min(self.sizes)}), "
                f"got {self.queries_per_book}"
            )
        if self.max_new_tokens < 1:
            raise ValueError(f"task.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"task.limit must be a positive number of samples or null, got {self.limit}")
        if self.locale not in AVAILABLE_LOCALES:
            raise ValueError(f"task.locale {self.locale!r} is not a Faker locale (e.g. 'en_US'; "
                             "see faker.config.AVAILABLE_LOCALES)")

    def samples(self) -> Iterator[Sample]:
        emitted = 0
        for book_index in range(self.books_per_size):
            for size in self.sizes:
                for sample in self._book_samples(size, book_index):
                    yield sample
                    emitted += 1
                    if self.limit is not None and emitted >= self.limit:
                        return

    def _book_samples(self, size: int, book_index: int) -> list[Sample]:
        seed = book_seed(self.seed, size, book_index)
        book = generate_book(size, seed, self.locale)
        book_text = "\n".join(format_entry(*entry) for entry in book)
        book_hash = hashlib.sha256(book_text.encode()).hexdigest()
        rng = random.Random(seed + 1)  # own stream: the queries never change the book
        samples = []
        for q, query in enumerate(rng.sample(range(size), self.queries_per_book)):
            picks = rng.sample(range(size - 1), 2)  # two other entries: skip over the query's index
            fewshot = tuple(i if i < query else i + 1 for i in picks)
            samples.append(
                Sample(
                    id=f"n{size}/b{book_index}/q{q}",
                    fields={
                        "prompt": build_prompt_text(book, query, fewshot),
                        "answer": book[query][1],
                        "query_name": book[query][0],
                        "size": size,
                        "book": book_index,
                        "query": q,
                        "query_index": query,
                        "fewshot_indices": list(fewshot),
                        "book_sha256": book_hash,
                    },
                )
            )
        return samples

    context_split: ClassVar[str | None] = ("the query: the last line, \"{name}:\" (the book and the two few-shot "
                                           "entries, which are lines of the book, are the context)")

    def build_prompt(self, sample: Sample, tokenizer: Any, max_length: int | None, query_aware: bool = True) -> Prompt:
        fields = sample.fields
        input_ids = encode_user_turn(tokenizer, fields["prompt"], chat=self.chat_template)
        context_tokens = None
        if not query_aware:  # the query "{name}:" after the last blank line (build_prompt_text)
            text = fields["prompt"]
            rendered, add_special = render_user_turn(tokenizer, text, chat=self.chat_template)
            split = locate(rendered, text, "phonebook") + text.rindex("\n\n") + 2
            input_ids, context_tokens = split_encode(tokenizer, rendered, split, add_special)
        info = {
            "size": fields["size"],
            "book": fields["book"],
            "query_index": fields["query_index"],
            "depth": fields["query_index"] / (fields["size"] - 1),
            "fewshot_indices": fields["fewshot_indices"],
            "book_sha256": fields["book_sha256"],
            "exceeds_max_length": max_length is not None and len(input_ids) > max_length,
        }
        generation = GenerationSettings(max_new_tokens=self.max_new_tokens, do_sample=False)
        return Prompt(input_ids=input_ids, generation=generation, info=info, context_tokens=context_tokens)

    def score(self, sample: Sample, prediction: str) -> dict[str, float]:
        """exact: first output line == number (primary, Jelassi); lenient: first 10-digit number == it."""
        answer = sample.fields["answer"]
        found = _PHONE.search(prediction)
        return {
            "exact": float(first_line(prediction) == answer),
            "lenient": float(found is not None and found.group() == answer),
        }

    def summarize(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        """Overall accuracy plus, per size (string keys, ascending), mean accuracy, the standard deviation
        (n-1) of the per-book accuracies, and the number of queries."""
        by_size: dict[int, dict[int, list[dict[str, float]]]] = {}
        for row in rows:
            match = _SAMPLE_ID.match(row["sample_id"])
            if match is None:
                raise ValueError(f"not a phonebook sample id (n<size>/b<book>/q<query>): {row['sample_id']!r}")
            size, book = int(match.group(1)), int(match.group(2))
            by_size.setdefault(size, {}).setdefault(book, []).append(row["scores"])
        summary: dict[str, Any] = {"n": len(rows)}
        for metric in ("exact", "lenient"):
            summary[metric] = _mean([float(row["scores"][metric]) for row in rows])
        summary["by_size"] = {}
        for size in sorted(by_size):
            books = by_size[size]
            entry: dict[str, Any] = {"n": sum(len(scores) for scores in books.values())}
            for metric in ("exact", "lenient"):
                entry[metric] = _mean([float(s[metric]) for scores in books.values() for s in scores])
            per_book = [_mean([float(s["exact"]) for s in scores]) for scores in books.values()]
            entry["exact_std_books"] = statistics.stdev(per_book) if len(per_book) > 1 else None
            summary["by_size"][str(size)] = entry
        return summary

    def data_sources(self) -> dict[str, str]:
        inputs = {
            "generator_version": GENERATOR_VERSION,
            "faker": faker.VERSION,
            "locale": self.locale,
            "seed": self.seed,
            "sizes": self.sizes,
            "books_per_size": self.books_per_size,
            "queries_per_book": self.queries_per_book,
        }
        label = f"phonebook generator v{GENERATOR_VERSION} (Faker {faker.VERSION}, {self.locale}, seed {self.seed})"
        return {label: hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()}


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None
