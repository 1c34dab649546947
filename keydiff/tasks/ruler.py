"""RULER (Hsieh et al. 2024, NVIDIA/RULER): the 13 tasks of the kvpress leaderboard, generated offline.

Design: docs/design/tasks.md#ruler
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar, Iterator

from keydiff.tasks.base import GenerationSettings, Prompt, Sample, Task, split_encode
from keydiff.tasks.ruler_generators import (
    QUESTION_MARKERS,
    RULER_COMMIT,
    CommonWords,
    FrequentWords,
    Generator,
    Niah,
    VariableTracking,
    essay_words,
    sub_seed,
    wonderwords_sources,
)
from keydiff.tasks.ruler_qa import QA, QAData, load_qa

log = logging.getLogger(__name__)

# Bump when a change in the generators changes the generated samples (2: RULER pinned at RULER_COMMIT).
GENERATOR_VERSION = 2
# A sample shorter than this share of task.length is flagged and kept out of the scores.
MIN_LENGTH_FRACTION = 0.95
ANSWER_PREFIX_STYLES = ("ruler", "kvpress")
QA_DOWNLOAD = ("RULER's scripts/data/synthetic/json/download_qa_dataset.sh writes both "
               "(https://rajpurkar.github.io/SQuAD-explorer/dataset/dev-v2.0.json -> squad.json, "
               "http://curtis.ml.cmu.edu/datasets/hotpot/hotpot_dev_distractor_v1.json -> hotpotqa.json)")
# The project's made-up QA files (tasks/README.md), in a source checkout: enough for a smoke run, not for scores.
QA_FIXTURE = Path(__file__).resolve().parents[2] / "tasks" / "fixtures" / "ruler"


def qa_fixture_hint() -> str:
    """"; for a smoke run, ..." naming the shipped fixture as the docs do (relative to the working directory when
    it lies below it), or "" where this install has no fixture (a wheel ships keydiff/ only)."""
    if not (QA_FIXTURE / "squad.json").is_file():
        return ""
    try:
        where = QA_FIXTURE.relative_to(Path.cwd().resolve())
    except ValueError:
        where = QA_FIXTURE
    return (f"; for a smoke run, the project's made-up QA fixture: task.data_dir={where.as_posix()} (its qa scores "
            "are marked as the fixture's, not comparable to RULER's)")

# name -> (generator class, arguments): RULER's synthetic.yaml.
SPECS: dict[str, tuple[type[Generator], dict[str, Any]]] = {
    "niah_single_1": (Niah, dict(haystack="noise", type_k="words", type_v="numbers")),
    "niah_single_2": (Niah, dict(haystack="essay", type_k="words", type_v="numbers")),
    "niah_single_3": (Niah, dict(haystack="essay", type_k="words", type_v="uuids")),
    "niah_multikey_1": (Niah, dict(haystack="essay", type_k="words", type_v="numbers", num_k=4)),
    "niah_multikey_2": (Niah, dict(haystack="needle", type_k="words", type_v="numbers")),
    "niah_multikey_3": (Niah, dict(haystack="needle", type_k="uuids", type_v="uuids")),
    "niah_multivalue": (Niah, dict(haystack="essay", type_k="words", type_v="numbers", num_v=4)),
    "niah_multiquery": (Niah, dict(haystack="essay", type_k="words", type_v="numbers", num_q=4)),
    "vt": (VariableTracking, dict(num_chains=1, num_hops=4)),
    "cwe": (CommonWords, dict(freq_cw=30, freq_ucw=3, num_cw=10)),
    "fwe": (FrequentWords, dict(alpha=2.0)),
    "qa_1": (QA, dict(dataset="squad")),
    "qa_2": (QA, dict(dataset="hotpotqa")),
}
STANDARD_TASKS: tuple[str, ...] = tuple(SPECS)
PRESETS: dict[str, tuple[str, ...]] = {
    "all": STANDARD_TASKS,
    "synthetic": tuple(t for t in STANDARD_TASKS if not t.startswith("qa_")),
}
_CONTROL = re.compile(r"[\x00-\x1f]")


def postprocess(prediction: str) -> str:
    """RULER's evaluate.py: strip, control characters to newlines, strip again."""
    return _CONTROL.sub("\n", prediction.strip()).strip()


def string_match_all(prediction: str, references: list[str]) -> float:
    """Share of the references contained in the prediction, case-insensitive."""
    pred = prediction.lower()
    return sum(1.0 for r in references if r.lower() in pred) / len(references)


def string_match_part(prediction: str, references: list[str]) -> float:
    """1 if any reference is contained in the prediction, case-insensitive."""
    pred = prediction.lower()
    return max(1.0 if r.lower() in pred else 0.0 for r in references)


def metric_of(task: str) -> Callable[[str, list[str]], float]:
    return string_match_part if task.startswith("qa_") else string_match_all


def fit_size(measure: Callable[[int], int], target: int, low: int, high: int | None) -> int:
    """Largest size in [low, high] with measure(size) <= target: doubling, then bisection. ``measure`` is close to
    monotone; the result always satisfies the bound."""
    if measure(low) > target:
        raise ValueError(f"even the smallest haystack ({low}) needs {measure(low)} tokens, above {target}")
    if high is not None and measure(high) <= target:
        return high
    good, bad = low, None
    step = max(1, low)
    while bad is None:
        probe = good + step if high is None else min(good + step, high)
        if measure(probe) <= target:
            good, step = probe, step * 2
        else:
            bad = probe
    while bad - good > 1:
        mid = (good + bad) // 2
        if measure(mid) <= target:
            good = mid
        else:
            bad = mid
    return good


def load_essay(haystack_dir: str | None, source: str = "pinned") -> tuple[tuple[str, ...], dict[str, str], str]:
    """The essay haystack as RULER's niah uses it (one loader for ruler and shared_ruler_4k): its words, its files'
    hashes and its kind. `source`: the default haystack's, where `haystack_dir` is None."""
    from keydiff.tasks.haystack import load_haystack

    haystack = load_haystack(haystack_dir, source)
    return tuple(essay_words(haystack.text)), dict(haystack.sources), haystack.kind


def _as_list(tasks: Any) -> list[str] | Any:
    if isinstance(tasks, str):
        return list(PRESETS.get(tasks, [tasks]))
    return [str(t) for t in tasks] if isinstance(tasks, (list, tuple)) else tasks


@dataclass
class Ruler(Task):
    """RULER at one target length (tokens, generation included), `num_samples` samples per task, index-major (sample
    0 of every task, then 1, ...), so a partial run covers every task; `limit` keeps the first of each task."""

    name: str = "ruler_4k"
    length: int = 4096
    tasks: Any = "all"  # "all" (13), "synthetic" (11, no QA data needed) or a list of task names
    num_samples: int = 500  # per task (kvpress's leaderboard data: 500)
    limit: int | None = None
    seed: int = 42  # RULER's default random_seed
    haystack_dir: str | None = None  # essay haystack: .txt folder or RULER's PaulGrahamEssays.json; None: pydoc prose
    haystack_source: str = "pinned"  # the pydoc prose: "pinned" (the repository's) or "interpreter" (this Python's)
    data_dir: str | None = None  # folder with squad.json and hotpotqa.json, for qa_1 / qa_2
    chat_template: bool = True
    answer_prefix_style: str = "ruler"  # "ruler": " The special..." after the generation prompt; "kvpress"
    max_new_tokens: int | None = None  # None: RULER's per-task tokens to generate

    _generators: dict[str, Generator] = field(default_factory=dict, init=False, repr=False, compare=False)
    _qa: dict[str, QAData] = field(default_factory=dict, init=False, repr=False, compare=False)
    _essay: tuple[str, ...] | None = field(default=None, init=False, repr=False, compare=False)
    _essay_sources: dict[str, str] = field(default_factory=dict, init=False, repr=False, compare=False)
    _essay_kind: str | None = field(default=None, init=False, repr=False, compare=False)
    _last: tuple[Any, Prompt] | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.tasks = _as_list(self.tasks)

    def validate(self) -> None:
        if not isinstance(self.tasks, list) or not self.tasks:
            raise ValueError(f"task.tasks must be a preset {list(PRESETS)} or a non-empty list of {list(STANDARD_TASKS)}")
        unknown = [t for t in self.tasks if t not in SPECS]
        if unknown:
            raise ValueError(f"unknown RULER task(s) {unknown} in task.tasks; valid tasks: {', '.join(STANDARD_TASKS)} "
                             f"(or a preset: {', '.join(PRESETS)})")
        if len(set(self.tasks)) != len(self.tasks):
            raise ValueError(f"task.tasks repeats a task: {self.tasks}")
        for key in ("length", "num_samples"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"task.{key} must be a positive integer, got {value!r}")
        if self.limit is not None and (isinstance(self.limit, bool) or not isinstance(self.limit, int) or self.limit < 1):
            raise ValueError(f"task.limit must be null or a positive integer, got {self.limit!r}")
        if self.max_new_tokens is not None and (not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1):
            raise ValueError(f"task.max_new_tokens must be null (RULER's per-task values) or a positive integer, "
                             f"got {self.max_new_tokens!r}")
        if self.answer_prefix_style not in ANSWER_PREFIX_STYLES:
            raise ValueError(f"task.answer_prefix_style={self.answer_prefix_style!r} is not valid; choose one of "
                             f"{list(ANSWER_PREFIX_STYLES)}")
        from keydiff.tasks.haystack import RULER_ESSAYS, check_source

        check_source(self.haystack_source)
        if self.haystack_dir is not None:
            path = Path(self.haystack_dir).expanduser()
            usable = (path.is_file() and path.suffix == ".json") or (
                path.is_dir() and (any(p.suffix == ".txt" for p in path.iterdir()) or (path / RULER_ESSAYS).is_file()))
            if not usable:
                raise ValueError(f"task.haystack_dir={self.haystack_dir!r} is not a folder of .txt files nor RULER's "
                                 f"{RULER_ESSAYS} (or a folder holding it)")
        qa = [t for t in self.tasks if t.startswith("qa_")]
        if qa and self.data_dir is None:
            raise ValueError(
                f"RULER {', '.join(qa)} need task.data_dir: a folder with squad.json (SQuAD v2.0 dev) and "
                f"hotpotqa.json (HotpotQA dev distractor); {QA_DOWNLOAD}; or run without them: task.tasks=synthetic"
                f"{qa_fixture_hint()}"
            )
        for t in qa:
            self._qa_data(SPECS[t][1]["dataset"])  # missing or malformed files fail here, before the model loads

    def check_model(self, max_length: int | None) -> None:
        if max_length is not None and self.length > max_length:
            raise ValueError(
                f"task.length={self.length} exceeds the model's max_length ({max_length}); use a shorter preset "
                f"(ruler_4k, ruler_8k, ...) or a model with a longer context"
            )

    def _qa_data(self, dataset: str) -> QAData:
        if dataset not in self._qa:
            assert self.data_dir is not None
            self._qa[dataset] = load_qa(self.data_dir, dataset)
        return self._qa[dataset]

    def _essay_words(self) -> tuple[str, ...]:
        if self._essay is None:
            self._essay, self._essay_sources, self._essay_kind = load_essay(self.haystack_dir, self.haystack_source)
        return self._essay

    def haystack_of(self, task: str) -> str:
        """What fills `task`'s context: the essay haystack's kind (pydoc_pinned / pydoc / txt_dir / ruler_json), RULER's
        noise or needle lines, the word list, coded words, or the QA data (with "fixture" for the project's)."""
        cls, kwargs = SPECS[task]
        if cls is Niah:
            if kwargs["haystack"] != "essay":
                return kwargs["haystack"]
            self._essay_words()
            return f"essay:{self._essay_kind}"
        if cls is QA:
            if self.data_dir is None:
                return f"{kwargs['dataset']}:unknown"
            data = self._qa_data(kwargs["dataset"])
            return f"{kwargs['dataset']}:{'fixture' if data.is_fixture else 'file'}"
        return {VariableTracking: "noise", CommonWords: "wonderwords", FrequentWords: "coded_words"}[cls]

    def not_comparable(self, tasks: list[str]) -> list[str]:
        """Why scores over `tasks` cannot be set beside published RULER numbers (empty: nothing known)."""
        kinds = {self.haystack_of(t) for t in tasks}
        reasons = []
        if any(k.startswith("essay:pydoc") for k in kinds):
            reasons.append("essay haystack is pydoc prose, not Paul Graham essays (set task.haystack_dir)")
        if any(k.endswith(":fixture") for k in kinds):
            reasons.append("QA ran on the project's made-up fixture, not SQuAD/HotpotQA")
        return reasons

    def generator(self, task: str) -> Generator:
        if task not in self._generators:
            cls, kwargs = SPECS[task]
            kwargs = dict(kwargs)
            if cls is Niah and kwargs["haystack"] == "essay":
                kwargs["essay"] = self._essay_words()
            if cls is QA:
                kwargs["data"] = self._qa_data(kwargs["dataset"])
            self._generators[task] = cls(**kwargs)
        return self._generators[task]

    def plan(self, task: str, index: int) -> dict[str, Any]:
        """Everything the answer of sample `index` of `task` depends on (no tokenizer involved)."""
        rng = random.Random(sub_seed("ruler", self.seed, task, self.length, index))
        gen = self.generator(task)
        return gen.plan(rng, self.length, index) if isinstance(gen, QA) else gen.plan(rng, self.length)

    def tokens_to_generate(self, task: str) -> int:
        return self.max_new_tokens or self.generator(task).template()["tokens_to_generate"]

    def samples(self) -> Iterator[Sample]:
        count = self.num_samples if self.limit is None else min(self.num_samples, self.limit)
        available = {t: len(self._qa_data(SPECS[t][1]["dataset"]).questions) for t in self.tasks if t.startswith("qa_")}
        for t, n in available.items():
            if n < count:
                log.warning("RULER %s: only %d answerable questions in task.data_dir, fewer than %d samples", t, n, count)
        for index in range(count):
            for task in self.tasks:
                if index >= available.get(task, count):
                    continue
                plan = self.plan(task, index)
                yield Sample(id=f"{task}/{index}", fields={
                    "task": task, "index": index, "length": self.length, "query": plan["query"] if "query" in plan else None,
                    "answers": list(plan["answers"]),
                })

    def encode(self, tokenizer: Any, user_text: str, answer_prefix: str) -> tuple[list[int], str, bool]:
        """(input ids, the rendered string, add_special_tokens) of one user turn followed by the answer prefix.
        ``answer_prefix_style: kvpress`` moves the prefix's leading whitespace to the user turn's end, as kvpress."""
        if self.answer_prefix_style == "kvpress":
            stripped = answer_prefix.lstrip()
            user_text, answer_prefix = user_text + answer_prefix[: len(answer_prefix) - len(stripped)], stripped
            if not (self.chat_template and getattr(tokenizer, "chat_template", None)):
                user_text += "\n"
        if self.chat_template and getattr(tokenizer, "chat_template", None):
            # enable_thinking=False: a thinking template (Qwen3) closes an empty <think></think> block, so the
            # answer prefix starts the answer, as kvpress's pipeline renders it; templates without it ignore it.
            rendered = tokenizer.apply_chat_template(
                [{"role": "user", "content": user_text}], tokenize=False, add_generation_prompt=True,
                enable_thinking=False,
            ) + answer_prefix
            return list(tokenizer(rendered, add_special_tokens=False)["input_ids"]), rendered, False
        rendered = user_text + answer_prefix
        return list(tokenizer(rendered)["input_ids"]), rendered, True

    context_split: ClassVar[str | None] = ("kvpress's RULER split: before the last match of the task's question "
                                           "pattern (QUESTION_MARKERS)")

    def build_prompt(self, sample: Sample, tokenizer: Any, max_length: int | None, query_aware: bool = True) -> Prompt:
        key = (sample.id, id(tokenizer), max_length, query_aware)
        if self._last is not None and self._last[0] == key:
            return self._last[1]
        task, index = sample.fields["task"], int(sample.fields["index"])
        gen = self.generator(task)
        plan = self.plan(task, index)
        to_generate = self.tokens_to_generate(task)
        example, example_size = "", None
        if gen.example_length is not None:  # vt's in-context example: its input fitted to 500 tokens (RULER)
            example_size = fit_size(
                lambda s: len(tokenizer(gen.example_input(plan, s), add_special_tokens=False)["input_ids"]),
                gen.example_length, gen.example_min_size(plan), None,
            )
            example = gen.example(plan, example_size)

        def measure(size: int) -> int:
            return len(self.encode(tokenizer, *gen.render(plan, size, example))[0]) + to_generate

        try:
            size = fit_size(measure, self.length, gen.min_size(plan), gen.max_size(plan))
        except ValueError as error:
            raise ValueError(f"RULER {task} at task.length={self.length}: {error}; use a larger length") from None
        user_text, answer_prefix = gen.render(plan, size, example)
        input_ids, rendered, add_special = self.encode(tokenizer, user_text, answer_prefix)
        marks = list(QUESTION_MARKERS[gen.kind].finditer(rendered))
        context_tokens = None
        if not query_aware:  # kvpress's split (the last question match) and tokenisation (context, rest apart);
            # the haystack size stays the one fitted above, so both protocols ask about the same text
            input_ids, context_tokens = split_encode(tokenizer, rendered, marks[-1].start(), add_special)
        if max_length is not None and len(input_ids) > max_length:
            raise ValueError(f"RULER {task}: prompt of {len(input_ids)} tokens exceeds the model's max_length {max_length}")
        question_index = context_tokens if context_tokens is not None else (
            len(tokenizer(rendered[: marks[-1].start()], add_special_tokens=add_special)["input_ids"]) if marks else None)
        fraction = (len(input_ids) + to_generate) / self.length
        if fraction < MIN_LENGTH_FRACTION:
            log.warning("RULER %s: prompt + %d to generate fill only %.1f %% of task.length=%d (data too small); "
                        "the sample is flagged short and kept out of the scores", sample.id, to_generate,
                        100 * fraction, self.length)
        info = {
            "task": task,
            "index": index,
            "length": self.length,
            "haystack": self.haystack_of(task),
            "length_fraction": round(fraction, 4),
            "short": fraction < MIN_LENGTH_FRACTION,
            "haystack_size": size,
            "haystack_capped": gen.max_size(plan) is not None and size == gen.max_size(plan),
            "example_size": example_size,
            "prompt_tokens": len(input_ids),
            "question_token_index": question_index,
            "answers": list(plan["answers"]),
        }
        prompt = Prompt(input_ids=input_ids, generation=GenerationSettings(max_new_tokens=to_generate), info=info,
                        context_tokens=context_tokens)
        self._last = (key, prompt)
        return prompt

    def score(self, sample: Sample, prediction: str) -> dict[str, float]:
        task = sample.fields["task"]
        return {"score": metric_of(task)(postprocess(prediction), list(sample.fields["answers"]))}

    def summarize(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        """Per task ``round(100 * mean score, 2)`` (RULER's evaluate.py) over its samples that fill the length, their
        mean as ``average``, counts (``n``, ``short``), each task's metric and haystack, and whether the average
        (all 13 standard tasks in) can be set beside published RULER numbers."""
        by_task: dict[str, list[float]] = {}
        short: dict[str, int] = {}
        for row in rows:
            task = row["sample_id"].split("/")[0]
            if (row.get("info") or {}).get("short", False):
                short[task] = short.get(task, 0) + 1
            else:
                by_task.setdefault(task, []).append(float(row["scores"]["score"]))
        seen = set(by_task) | set(short)
        order = [t for t in STANDARD_TASKS if t in seen] + sorted(t for t in seen if t not in SPECS)
        scores = {t: round(100 * sum(by_task[t]) / len(by_task[t]), 2) for t in order if t in by_task}
        known = [t for t in order if t in SPECS]
        reasons = self.not_comparable(known)
        return {
            "average": round(sum(scores.values()) / len(scores), 2) if scores else None,
            "tasks": scores,
            "n": {t: len(by_task.get(t, [])) for t in order},
            "short": {t: short.get(t, 0) for t in order},
            "min_length_fraction": MIN_LENGTH_FRACTION,
            "metric": {t: metric_of(t).__name__ for t in order},
            "length": self.length,
            "all_standard_tasks": set(STANDARD_TASKS) <= set(scores),
            "haystack": {t: self.haystack_of(t) for t in known},
            "comparable_to_published": not reasons,
            "not_comparable": reasons,
            "ruler_commit": RULER_COMMIT,
        }

    def data_sources(self) -> dict[str, str]:
        inputs = {"generator_version": GENERATOR_VERSION, "seed": self.seed, "length": self.length,
                  "tasks": self.tasks, "num_samples": self.num_samples, "ruler_commit": RULER_COMMIT}
        label = (f"ruler generator v{GENERATOR_VERSION} (NVIDIA/RULER@{RULER_COMMIT[:10]}, seed {self.seed}, "
                 f"length {self.length})")
        sources = {
            label: hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest(),
            **wonderwords_sources(),
        }
        if any(SPECS[t][1].get("haystack") == "essay" for t in self.tasks):
            self._essay_words()
            sources.update({f"ruler/essay[{self._essay_kind}]/{k}": v for k, v in self._essay_sources.items()})
        for t in self.tasks:
            if t.startswith("qa_"):
                sources.update(self._qa_data(SPECS[t][1]["dataset"]).source)
        return sources
