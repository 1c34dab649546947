"""The contract between a benchmark task and the runner: data -> `Sample`s, sample + tokenizer -> `Prompt`,
prediction -> scores. The runner owns everything in between, so a task never touches the model or cache.

Design: docs/design/tasks.md#the-contract
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, Iterator


@dataclass
class Sample:
    """One evaluation item. `id` must be unique and stable across runs: resuming skips ids already written."""

    id: str
    fields: dict[str, Any]


@dataclass
class GenerationSettings:
    """Decoding settings of one sample, as the task's official protocol prescribes them."""

    max_new_tokens: int
    do_sample: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    min_new_tokens: int = 0
    # Token ids that end generation in addition to the model's own end-of-sequence ids
    # (e.g. LongBench samsum stops at the newline token).
    stop_token_ids: tuple[int, ...] = ()
    # Seed for sampled decoding; None means the runner derives one from the run seed and sample id.
    seed: int | None = None


@dataclass
class Prompt:
    """A fully built prompt: token ids with every special token already in place (the runner adds none)."""

    input_ids: list[int]
    generation: GenerationSettings
    # Facts recorded verbatim in the result row (e.g. whether middle truncation happened, realised depth).
    info: dict[str, Any] = field(default_factory=dict)
    # Query-agnostic prompts (build_prompt(..., query_aware=False)): the leading ids that are the context, the
    # part that is compressed; the rest (question, end of the turn, answer prefix) is fed after it, held whole
    # up to the first generated token. None: the whole prompt is compressed (query_aware=True).
    context_tokens: int | None = None


@dataclass
class SharedContext:
    """One context and the questions asked over it (a task whose `mode` shares the context; keydiff.run.shared).

    `questions[j]`: question j's prompt as `build_prompt(..., query_aware=False)` builds it (`context_tokens` =
    len(context_ids)). `follow_ups[j]`: the ids that put question j after an earlier answer (multi_turn)."""

    context_ids: list[int]
    questions: list[Prompt]
    follow_ups: list[list[int]]


class Task(ABC):
    """Base class of every benchmark task. Subclasses are dataclasses whose fields come from `conf/task/*.yaml`."""

    name: str
    # Where the task's prompt splits into context and question under query_aware=false (one line, for the docs
    # and error messages); None: the task has no context apart from its question, and query_aware=false is refused.
    context_split: ClassVar[str | None] = None
    # How the questions over one context are asked (keydiff.run.shared): "independent" (every sample is its own
    # prompt, the default), or, for a task whose shard groups are the questions of one context and which builds
    # `shared_context`, "multi_request" (one compression, each question from a copy of it) or "multi_turn".
    mode = "independent"

    def validate(self) -> None:
        """Check the configuration cheaply, before any model is loaded. Raise ValueError naming valid choices."""

    def check_model(self, max_length: int | None) -> None:
        """Check the task against the model's context length before loading it (e.g. NIAH lengths)."""

    @abstractmethod
    def samples(self) -> Iterator[Sample]:
        """Yield the samples of this run in a deterministic order."""

    @abstractmethod
    def build_prompt(self, sample: Sample, tokenizer: Any, max_length: int | None) -> Prompt:
        """Build the model input. `max_length` is the model's context length used for truncation (None: no limit).
        A task with a `context_split` also takes `query_aware=False`: context and rest encoded apart (`split_encode`)."""

    def shared_context(self, samples: list[Sample], tokenizer: Any, max_length: int | None) -> SharedContext:
        """The context that `samples` (one shard group, in order) share and their question prompts; only tasks
        with a shared `mode` build it."""
        raise NotImplementedError(f"task {self.name!r} asks no several questions over one context")

    @abstractmethod
    def score(self, sample: Sample, prediction: str) -> dict[str, float]:
        """Score one raw decoded prediction (special tokens skipped, otherwise unstripped)."""

    def summarize(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        """Aggregate the per-sample result rows (each has "sample_id", "scores", "info", ...) into run metrics: by
        default the plain mean of every score name; tasks with an official aggregate override it."""
        totals: dict[str, list[float]] = {}
        for row in rows:
            for key, value in row["scores"].items():
                totals.setdefault(key, []).append(float(value))
        return {key: sum(values) / len(values) for key, values in totals.items() if values}

    def shard_group(self, sample: Sample) -> str:
        """Samples of one group stay in one shard when a grid point is split across jobs (`shard=i/n`,
        keydiff.run.shards), e.g. responses sharing a prefill. By default every sample is its own group."""
        return sample.id

    def data_sources(self) -> dict[str, str]:
        """Name -> sha256 of every data file or generator input the samples came from (recorded in results)."""
        return {}

    def hub_downloads(self) -> list[str]:
        """What `samples()` would download from the Hub, each with its offline alternative; [] when the data is local or
        cached. Non-empty with the Hub unreachable: the run is refused (keydiff.run.checks)."""
        return []


def encode_user_turn(tokenizer: Any, text: str, chat: bool = True) -> list[int]:
    """Token ids of `text` as one user turn, with the generation prompt, through the chat template (which holds BOS);
    without one (or `chat=False`) the text with the tokenizer's own special tokens."""
    if chat and getattr(tokenizer, "chat_template", None):
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
        )
        return list(tokenizer(rendered, add_special_tokens=False)["input_ids"])
    return list(tokenizer(text)["input_ids"])


def render_user_turn(tokenizer: Any, text: str, chat: bool = True, **template_kwargs: Any) -> tuple[str, bool]:
    """(the rendered string, add_special_tokens) that `encode_user_turn` encodes: `text` as one user turn with the
    generation prompt, or the text alone (the tokenizer then adds its own special tokens) without a template."""
    if chat and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True, **template_kwargs), False
    return text, True


def split_encode(tokenizer: Any, rendered: str, split: int, add_special_tokens: bool) -> tuple[list[int], int]:
    """A query-agnostic prompt as kvpress's pipeline tokenises it: the text before character `split` (the context,
    with BOS) and after it encoded apart, then concatenated. Returns (ids, the number of context ids)."""
    if not 0 < split < len(rendered):
        raise ValueError(f"cannot split a prompt of {len(rendered)} characters at {split}: both context and question "
                         "must be non-empty")
    context = list(tokenizer(rendered[:split], add_special_tokens=add_special_tokens)["input_ids"])
    rest = list(tokenizer(rendered[split:], add_special_tokens=False)["input_ids"])
    return context + rest, len(context)


def locate(rendered: str, text: str, task: str) -> int:
    """Where `text` (the user turn) starts in `rendered` (the chat template's output); a clear error if the
    template rewrote it, since the question's place in it is then unknown."""
    start = rendered.find(text)
    if start < 0:
        raise ValueError(f"{task}: the chat template rewrote the user turn, so the question cannot be split from "
                         "the context (query_aware=false); use query_aware=true or task.chat_template=false")
    return start
