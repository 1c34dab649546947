"""The contract between a benchmark task and the runner.

A task turns its data into `Sample`s, a sample plus a tokenizer into a `Prompt` (token ids and the
decoding settings of the official protocol), and a decoded prediction into scores. The runner owns
everything in between (block-wise prefill, eviction, decoding, timing, result files), so a task never
touches the model or the cache.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Iterator


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


class Task(ABC):
    """Base class of every benchmark task. Subclasses are dataclasses whose fields come from `conf/task/*.yaml`."""

    name: str

    def validate(self) -> None:
        """Check the configuration cheaply, before any model is loaded. Raise ValueError naming valid choices."""

    def check_model(self, max_length: int | None) -> None:
        """Check the task against the model's context length before loading it (e.g. NIAH lengths)."""

    @abstractmethod
    def samples(self) -> Iterator[Sample]:
        """Yield the samples of this run in a deterministic order."""

    @abstractmethod
    def build_prompt(self, sample: Sample, tokenizer: Any, max_length: int | None) -> Prompt:
        """Build the model input. `max_length` is the model's context length used for truncation (None: no limit)."""

    @abstractmethod
    def score(self, sample: Sample, prediction: str) -> dict[str, float]:
        """Score one raw decoded prediction (special tokens skipped, otherwise unstripped)."""

    def summarize(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        """Aggregate the per-sample result rows (each has "sample_id", "scores", "info", ...) into run metrics.

        The default is the plain mean of every score name; tasks with an official aggregate override it.
        """
        totals: dict[str, list[float]] = {}
        for row in rows:
            for key, value in row["scores"].items():
                totals.setdefault(key, []).append(float(value))
        return {key: sum(values) / len(values) for key, values in totals.items() if values}

    def shard_group(self, sample: Sample) -> str:
        """Samples of the same group stay in the same shard when a grid point is split across jobs
        (`shard=i/n`, keydiff.run.shards): e.g. several responses to one prompt, which share its prefill.
        By default every sample is a group of its own."""
        return sample.id

    def data_sources(self) -> dict[str, str]:
        """Name -> sha256 of every data file or generator input the samples came from (recorded in results)."""
        return {}

    def hub_downloads(self) -> list[str]:
        """What `samples()` would download from the Hugging Face Hub, each with its offline alternative
        ("LongBench's data.zip (offline: task.data_dir=...)"); [] when the data is local or cached. The run
        is refused in seconds when the Hub is unreachable and this is not empty (keydiff.run.checks)."""
        return []


def encode_user_turn(tokenizer: Any, text: str, chat: bool = True) -> list[int]:
    """Token ids of `text` as one user turn, with the generation prompt when the tokenizer has a chat template.

    Without a chat template (or with `chat=False`) the text is encoded with the tokenizer's own special
    tokens (BOS where the model uses one). The template output already holds BOS, so it is encoded with
    `add_special_tokens=False` to avoid a double BOS.
    """
    if chat and getattr(tokenizer, "chat_template", None):
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
        )
        return list(tokenizer(rendered, add_special_tokens=False)["input_ids"])
    return list(tokenizer(text)["input_ids"])
