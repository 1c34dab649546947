"""RULER's synthetic task generators (NVIDIA/RULER scripts/data/synthetic at `RULER_COMMIT`), written for this
project. `plan(rng)` draws what the answer depends on and `render(plan, size)` builds the text, so the gold
answer never depends on the tokenizer. Design: docs/design/tasks.md#ruler
"""

# The templates below are data copied verbatim from RULER's constants.py at RULER_COMMIT.
# ruff: noqa: E501

from __future__ import annotations

import hashlib
import importlib.resources
import math
import random
import re
import string
import uuid
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

RULER_COMMIT = "c3f5e3b4f87f97e048793bb510a3a6b19a46bf3a"  # NVIDIA/RULER main, 2026-07-22

TEMPLATES: dict[str, dict[str, Any]] = {
    "niah": {
        "tokens_to_generate": 128,
        "template": "Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. I will quiz you about the {type_needle_v} afterwards.\n{context}\nWhat are all the special magic {type_needle_v} for {query} mentioned in the provided text?",
        "answer_prefix": " The special magic {type_needle_v} for {query} mentioned in the provided text are",
    },
    "variable_tracking": {
        "tokens_to_generate": 30,
        "template": "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\nQuestion: Find all variables that are assigned the value {query} in the text above.",
        "answer_prefix": " Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are assigned the value {query}, they are: ",
    },
    "common_words_extraction": {
        "tokens_to_generate": 120,
        "template": "Below is a numbered list of words. In these words, some appear more often than others. Memorize the ones that appear most often.\n{context}\nQuestion: What are the 10 most common words in the above list?",
        "answer_prefix": " Answer: The top 10 words that appear most often in the list are:",
    },
    "freq_words_extraction": {
        "tokens_to_generate": 50,
        "template": "Read the following coded text and track the frequency of each coded word. Find the three most frequently appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore the dots '....'. What are the three most frequently appeared words in the above coded text?",
        "answer_prefix": " Answer: According to the coded text above, the three most frequently appeared words are:",
    },
    "qa": {
        "tokens_to_generate": 32,
        "template": "Answer the question based on the given documents. Only give me the answer and do not output any other words.\n\nThe following are given documents.\n\n{context}\n\nAnswer the question based on the given documents. Only give me the answer and do not output any other words.\n\nQuestion: {query}",
        "answer_prefix": " Answer:",
    },
}
# Where the question starts in each template (kvpress's split of RULER inputs into context / question).
QUESTION_MARKERS = {
    "niah": re.compile(r"What (?:is|are all) the special magic"),
    "variable_tracking": re.compile(r"Question: Find all variables that are assigned the value"),
    "common_words_extraction": re.compile(r"Question: What are the 10 most common words in the above list\?"),
    "freq_words_extraction": re.compile(r"Question: Do not provide any explanation\."),
    "qa": re.compile(r"Answer the question based on the given documents\."),
}

NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
# Needle depths of the essay haystack: np.round(np.linspace(0, 100, 40)) as integers.
DEPTHS = [int(math.floor(100 * i / 39 + 0.5)) for i in range(40)]


def sub_seed(*parts: Any) -> int:
    """A 64-bit seed from any parts, stable across machines and Python hash seeds."""
    return int.from_bytes(hashlib.sha256("|".join(map(str, parts)).encode()).digest()[:8], "big")


@lru_cache(maxsize=None)
def wonderwords_list(name: str) -> tuple[str, ...]:
    """One of wonderwords' word lists ("nounlist.txt", "adjectivelist.txt", "verblist.txt"), lines right-stripped."""
    text = importlib.resources.files("wonderwords.assets").joinpath(name).read_text(encoding="utf-8")
    return tuple(line.rstrip() for line in text.splitlines() if line.strip())


def wonderwords_sources() -> dict[str, str]:
    """sha256 of each word list used, keyed by package version and file (the lists differ between versions)."""
    import wonderwords

    version = getattr(wonderwords, "__version__", "?")
    out = {}
    for name in ("nounlist.txt", "adjectivelist.txt", "verblist.txt"):
        data = importlib.resources.files("wonderwords.assets").joinpath(name).read_bytes()
        out[f"wonderwords=={version}/{name}"] = hashlib.sha256(data).hexdigest()
    return out


@lru_cache(maxsize=None)
def cwe_words() -> tuple[str, ...]:
    """RULER's common-words vocabulary: sorted set of nouns + adjectives + verbs."""
    return tuple(sorted(set(wonderwords_list("nounlist.txt") + wonderwords_list("adjectivelist.txt") + wonderwords_list("verblist.txt"))))


def random_value(kind: str, rng: random.Random) -> str:
    """A needle key or value: "words" (adjective-noun), "numbers" (7 digits) or "uuids" (version 4)."""
    if kind == "words":
        return f"{rng.choice(wonderwords_list('adjectivelist.txt'))}-{rng.choice(wonderwords_list('nounlist.txt'))}"
    if kind == "numbers":
        return str(rng.randint(10**6, 10**7 - 1))
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    raise ValueError(f"needle type {kind!r} is not valid; choose one of ['words', 'numbers', 'uuids']")


_SENTENCE_END = re.compile(r"[.!?][\"')\]]*(\s+)(?=[\"'(\[]?[A-Z0-9])")


def split_sentences(text: str) -> list[str]:
    """Sentences of plain prose: a break after . ! ? (and closing quotes) followed by an upper-case start."""
    text = text.strip()
    parts, start = [], 0
    for match in _SENTENCE_END.finditer(text):
        parts.append(text[start : match.start(1)])
        start = match.end(1)
    parts.append(text[start:])
    return [part.strip() for part in parts if part.strip()]


def essay_words(text: str) -> list[str]:
    """RULER's essay haystack unit: whitespace-separated words of the whole text."""
    return re.sub(r"\s+", " ", text).strip().split(" ")


class Generator:
    """Base of the task generators. `kind` names the RULER template family."""

    kind: str = ""

    def plan(self, rng: random.Random, length: int) -> dict[str, Any]:
        raise NotImplementedError

    def render(self, plan: dict[str, Any], size: int, example: str = "") -> tuple[str, str]:
        raise NotImplementedError

    def min_size(self, plan: dict[str, Any]) -> int:
        return 1

    def max_size(self, plan: dict[str, Any]) -> int | None:
        """Largest haystack size available (None: unbounded, the haystack repeats)."""
        return None

    # In-context example (variable tracking only): a short instance whose input fits `example_length` tokens.
    example_length: int | None = None

    def example_input(self, plan: dict[str, Any], size: int) -> str:
        return ""

    def example(self, plan: dict[str, Any], size: int) -> str:
        return ""

    def example_min_size(self, plan: dict[str, Any]) -> int:
        return 1

    def template(self) -> dict[str, Any]:
        return TEMPLATES[self.kind]


def _join_query(queries: list[str]) -> str:
    return queries[0] if len(queries) == 1 else ", ".join(queries[:-1]) + ", and " + queries[-1]


@dataclass
class Niah(Generator):
    """Needle in a haystack with `num_k` keys of `num_v` values each; `num_q` keys are asked for."""

    haystack: str  # "essay", "noise" (RULER: repeat) or "needle"
    type_k: str
    type_v: str
    num_k: int = 1
    num_v: int = 1
    num_q: int = 1
    essay: tuple[str, ...] = ()  # the essay haystack's words (only for haystack="essay")
    kind: str = "niah"

    def plan(self, rng: random.Random, length: int) -> dict[str, Any]:
        num_k = max(self.num_k, self.num_q)
        keys: list[str] = []
        while len(keys) < num_k:
            key = random_value(self.type_k, rng)
            if key not in keys:
                keys.append(key)
        values = [[random_value(self.type_v, rng) for _ in range(self.num_v)] for _ in keys]
        needles = [NEEDLE.format(type_needle_v=self.type_v, key=k, value=v) for k, vs in zip(keys, values) for v in vs]
        rng.shuffle(needles)
        asked = rng.sample(range(num_k), self.num_q)
        return {
            "seed": rng.getrandbits(63),
            "keys": keys,
            "needles": needles,
            "depths": rng.sample(DEPTHS, len(needles)),
            "query": _join_query([keys[i] for i in asked]),
            "answers": [v for i in asked for v in values[i]],
        }

    def min_size(self, plan: dict[str, Any]) -> int:
        return len(plan["needles"]) if self.haystack != "essay" else 1

    def context(self, plan: dict[str, Any], size: int) -> str:
        needles = plan["needles"]
        rng = random.Random(sub_seed(plan["seed"], size))
        if self.haystack == "essay":
            words = [self.essay[i % len(self.essay)] for i in range(size)]
            sentences = split_sentences(" ".join(words))
            cuts = [0] + sorted(int(len(sentences) * depth / 100) for depth in plan["depths"]) + [len(sentences)]
            parts: list[str] = []
            for i in range(1, len(cuts)):
                chunk = " ".join(sentences[cuts[i - 1] : cuts[i]])
                if chunk:
                    parts.append(chunk)
                if i - 1 < len(needles):
                    parts.append(needles[i - 1])
            return " ".join(parts)
        if self.haystack == "noise":
            lines = [NOISE] * size
        elif self.haystack == "needle":
            lines = []
            while len(lines) < size:
                key = random_value(self.type_k, rng)
                if key not in plan["keys"]:  # a distractor never answers the question
                    lines.append(NEEDLE.format(type_needle_v=self.type_v, key=key, value=random_value(self.type_v, rng)))
        else:
            raise ValueError(f"haystack {self.haystack!r} is not valid; choose one of ['essay', 'noise', 'needle']")
        for index, needle in zip(sorted(rng.sample(range(size), len(needles)), reverse=True), needles):
            lines.insert(index, needle)
        return "\n".join(lines)

    def render(self, plan: dict[str, Any], size: int, example: str = "") -> tuple[str, str]:
        template, prefix = TEMPLATES["niah"]["template"], TEMPLATES["niah"]["answer_prefix"]
        type_v = self.type_v
        if self.num_q * self.num_v == 1:  # RULER's singular rewrite
            for old, new in (("Some", "A"), ("are all", "is"), ("are", "is"), ("answers", "answer")):
                template, prefix = template.replace(old, new), prefix.replace(old, new)
            type_v = type_v[:-1]
        context = self.context(plan, size)
        return (template.format(type_needle_v=type_v, context=context, query=plan["query"]),
                prefix.format(type_needle_v=type_v, query=plan["query"]))


@dataclass
class VariableTracking(Generator):
    """Chains ``VAR A = 12345``, ``VAR B = VAR A`` ... hidden in noise lines, with one in-context example."""

    num_chains: int = 1
    num_hops: int = 4
    kind: str = "variable_tracking"
    example_length: int | None = 500  # RULER fits its example's input to 500 tokens

    @staticmethod
    def _chains(rng: random.Random, num_chains: int, num_hops: int, letters: int) -> tuple[list[list[str]], list[list[str]]]:
        names: list[str] = []
        while len(names) < num_chains * (num_hops + 1):
            name = "".join(rng.choices(string.ascii_uppercase, k=letters))
            if name not in names:
                names.append(name)
        variables, chains = [], []
        for c in range(num_chains):
            chain_vars = names[c * (num_hops + 1) : (c + 1) * (num_hops + 1)]
            chain = [f"VAR {chain_vars[0]} = {rng.randint(10000, 99998)}"]
            chain += [f"VAR {chain_vars[j + 1]} = VAR {chain_vars[j]} " for j in range(num_hops)]
            variables.append(chain_vars)
            chains.append(chain)
        return variables, chains

    def plan(self, rng: random.Random, length: int) -> dict[str, Any]:
        variables, chains = self._chains(rng, self.num_chains, self.num_hops, 5)
        example_vars, example_chains = self._chains(rng, self.num_chains, min(10, self.num_hops), 3)
        return {
            "seed": rng.getrandbits(63),
            "chains": chains,
            "query": chains[0][0].split("=")[-1].strip(),
            "answers": variables[0],
            "example_chains": example_chains,
            "example_answers": example_vars[0],
        }

    def min_size(self, plan: dict[str, Any]) -> int:
        return max(len(chain) for chain in plan["chains"])

    def example_min_size(self, plan: dict[str, Any]) -> int:
        return max(len(chain) for chain in plan["example_chains"])

    @staticmethod
    def _context(chains: list[list[str]], size: int, rng: random.Random) -> str:
        """RULER's noise haystack: `size` noise lines with each chain's statements inserted in order, one per line."""
        sentences = [NOISE] * size
        for chain in chains:
            positions = sorted(rng.sample(range(len(sentences)), len(chain)))
            for offset, (position, statement) in enumerate(zip(positions, chain)):
                sentences.insert(position + offset, statement)
        return "\n".join(sentences).replace(". \n", ".\n")

    def _filled(self, chains: list[list[str]], size: int, seed: int) -> tuple[str, str, str]:
        t = TEMPLATES["variable_tracking"]
        query = chains[0][0].split("=")[-1].strip()
        context = self._context(chains, size, random.Random(sub_seed(seed, size)))
        num_v = len(chains[0])
        return t["template"].format(context=context, query=query), t["answer_prefix"].format(num_v=num_v, query=query), query

    def example_input(self, plan: dict[str, Any], size: int) -> str:
        """The in-context example's input (template + answer prefix, no model template): what RULER fits to
        `example_length` tokens (its answer and the tokens to generate are not counted)."""
        text, prefix, _ = self._filled(plan["example_chains"], size, sub_seed(plan["seed"], "example"))
        return text + prefix

    def example(self, plan: dict[str, Any], size: int) -> str:
        """RULER's example: its input, a space, its answer (the variable names), a newline."""
        return self.example_input(plan, size) + " " + " ".join(plan["example_answers"]) + "\n"

    def render(self, plan: dict[str, Any], size: int, example: str = "") -> tuple[str, str]:
        """The example goes right before the task template, joined by a newline (RULER's ``cutoff`` insert)."""
        text, prefix, _ = self._filled(plan["chains"], size, plan["seed"])
        return (example + "\n" + text if example else text), prefix


@dataclass
class CommonWords(Generator):
    """A numbered list where `num_cw` words appear `freq_cw` times and the others `freq_ucw` times."""

    freq_cw: int = 30
    freq_ucw: int = 3
    num_cw: int = 10
    kind: str = "common_words_extraction"

    def plan(self, rng: random.Random, length: int) -> dict[str, Any]:
        words = cwe_words()
        small = length < 4096  # RULER's short-context variant: example 20 words x 3/1, context x 6/1
        order = rng.sample(range(len(words)), len(words))  # the first `num_cw` are the common words
        return {
            "seed": rng.getrandbits(63),
            "order": order,
            "example": rng.sample(words, 20 if small else 40),
            "example_freq": [3, 1] if small else [10, 3],
            "freq": [6, 1] if small else [self.freq_cw, self.freq_ucw],
            "answers": [words[i] for i in order[: self.num_cw]],
        }

    def _list(self, words: list[str], common: int, freq: tuple[int, int], rng: random.Random) -> str:
        items = words[:common] * freq[0] + words[common:] * freq[1]
        rng.shuffle(items)
        return " ".join(f"{i + 1}. {w}" for i, w in enumerate(items))

    def min_size(self, plan: dict[str, Any]) -> int:
        return self.num_cw

    def max_size(self, plan: dict[str, Any]) -> int | None:
        return len(cwe_words())

    def render(self, plan: dict[str, Any], size: int, example: str = "") -> tuple[str, str]:
        t = TEMPLATES["common_words_extraction"]
        words = cwe_words()
        rng = random.Random(sub_seed(plan["seed"], size))
        example_words = list(plan["example"])
        example_ctx = self._list(example_words, self.num_cw, tuple(plan["example_freq"]), random.Random(sub_seed(plan["seed"], "example")))
        shown = " ".join(f"{i + 1}. {w}" for i, w in enumerate(example_words[: self.num_cw]))
        example_text = t["template"].format(context=example_ctx, query="") + t["answer_prefix"] + " " + shown
        context = self._list([words[i] for i in plan["order"][:size]], self.num_cw, tuple(plan["freq"]), rng)
        return example_text + "\n" + t["template"].format(context=context, query=""), t["answer_prefix"]


def zeta(s: float) -> float:
    """Riemann zeta for s > 1: a direct sum to N plus the Euler-Maclaurin tail (error < 1e-15 at N = 200)."""
    if s <= 1:
        raise ValueError(f"zeta needs s > 1, got {s}")
    n = 200
    head = math.fsum(k**-s for k in range(1, n))
    tail = n ** (1 - s) / (s - 1) + 0.5 * n**-s + s * n ** (-s - 1) / 12 - s * (s + 1) * (s + 2) * n ** (-s - 3) / 720
    return head + tail


@dataclass
class FrequentWords(Generator):
    """Coded text of random 6-letter words with Zipf(`alpha`) counts; the top word is shown as "...", the answer is
    ranks 2-4. Vocabulary size: ``(length - tokens to generate) // 50`` (RULER's default)."""

    alpha: float = 2.0
    word_length: int = 6
    vocab_size: int | None = None
    kind: str = "freq_words_extraction"

    def plan(self, rng: random.Random, length: int) -> dict[str, Any]:
        size = self.vocab_size or (length - TEMPLATES[self.kind]["tokens_to_generate"]) // 50
        vocab: set[str] = set()
        while len(vocab) < size:
            vocab.add("".join(rng.choices(string.ascii_lowercase, k=self.word_length)))
        words = sorted(vocab)
        rng.shuffle(words)
        words[0] = "..."  # the most frequent word is noise
        return {"seed": rng.getrandbits(63), "vocab": words, "answers": words[1:4]}

    def counts(self, plan: dict[str, Any], size: int) -> list[int]:
        z = zeta(self.alpha)
        return [int(size * k**-self.alpha / z) for k in range(1, len(plan["vocab"]) + 1)]

    def min_size(self, plan: dict[str, Any]) -> int:
        """Smallest word count whose ranks 2-4 are strictly more frequent than rank 5 (an unambiguous answer)."""
        if len(plan["vocab"]) < 4:
            raise ValueError(f"freq_words_extraction needs a vocabulary of at least 4 words, got {len(plan['vocab'])}")
        size = 1
        while True:
            c = self.counts(plan, size) + [0]
            if c[3] > c[4] and c[3] > 0:
                return size
            size += 1

    def render(self, plan: dict[str, Any], size: int, example: str = "") -> tuple[str, str]:
        t = TEMPLATES["freq_words_extraction"]
        items = [w for w, c in zip(plan["vocab"], self.counts(plan, size)) for _ in range(c)]
        random.Random(sub_seed(plan["seed"], size)).shuffle(items)
        return t["template"].format(context=" ".join(items), query=""), t["answer_prefix"]
