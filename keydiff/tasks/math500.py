"""Math-500 with the DeepSeek-R1 prompt and sampled decoding, as in KeyDiff Appendix E (Tables 4-7).

Design: docs/design/tasks.md#math-500
"""

from __future__ import annotations

import hashlib
import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

from keydiff.extras import installed, missing, require
from keydiff.tasks.base import GenerationSettings, Prompt, Sample, Task, encode_user_turn
from keydiff.tasks.math_answers import score_response

HUB_DATASET = "HuggingFaceH4/MATH-500"
DATA_FILE = "test.jsonl"
REQUIRED_FIELDS = ("problem", "answer", "unique_id")
PROMPT_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."
THINK_START = "<think>"
SUBSET_UNITS = ("sample", "problem_any", "problem_mean")


def build_user_turn(problem: str) -> str:
    """The DeepSeek-R1 user message for one problem (no system prompt)."""
    return problem + PROMPT_SUFFIX


def sample_seed(seed: int, sample_index: int) -> int:
    """Seed of the k-th response of every problem: a hash of (run seed, k), stable across machines, so different run
    seeds never share a sample seed."""
    digest = hashlib.sha256(f"math500|{seed}|{sample_index}".encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF


def problem_id(sample_id: str) -> str:
    """`test/algebra/1.json#3` -> `test/algebra/1.json`."""
    return sample_id.rsplit("#", 1)[0]


def sample_index(sample_id: str) -> int:
    """`test/algebra/1.json#3` -> 3."""
    return int(sample_id.rsplit("#", 1)[1])


@dataclass
class Math500(Task):
    """Math-500 task. `limit` counts problems (each still yields `num_samples` samples), so averages stay comparable.

    `force_think`: append `<think>\\n` after the generation prompt where the chat template lacks it and the
    tokenizer knows `<think>` (non-reasoning models are left untouched); `info["think_prefix_added"]` records it."""

    name: str = "math500"
    data_dir: str | None = None
    limit: int | None = None
    num_samples: int = 5
    temperature: float = 0.95
    top_p: float = 0.95
    max_new_tokens: int = 4096
    seed: int = 0
    chat_template: bool = True
    force_think: bool = True
    _problems: list[dict[str, Any]] | None = field(default=None, init=False, repr=False, compare=False)

    # ---- configuration and data ----------------------------------------------------------------

    def validate(self) -> None:
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"task.limit must be a positive number of problems or null, got {self.limit}")
        if self.num_samples < 1:
            raise ValueError(f"task.num_samples must be >= 1, got {self.num_samples}")
        if not self.temperature > 0:
            raise ValueError(f"task.temperature must be > 0 (sampled decoding), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"task.top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"task.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.data_dir is not None:
            path = Path(self.data_dir) / DATA_FILE
            if not path.is_file():
                raise ValueError(f"task.data_dir={self.data_dir!r} has no {DATA_FILE} (MATH-500 layout expected)")
        elif not installed("datasets"):
            raise missing("datasets", module="datasets", **_NO_DATASETS)

    def problems(self) -> list[dict[str, Any]]:
        """The problems of this run (after `limit`), loaded once."""
        if self._problems is None:
            self._problems = self._load()
        return self._problems[: self.limit] if self.limit is not None else self._problems

    def _load(self) -> list[dict[str, Any]]:
        if self.data_dir is not None:
            path = Path(self.data_dir) / DATA_FILE
            if not path.is_file():
                raise FileNotFoundError(f"task.data_dir={self.data_dir!r} has no {DATA_FILE}")
            lines = path.read_text(encoding="utf-8").splitlines()
            rows = [json.loads(line) for line in lines if line.strip()]
            where = str(path)
        else:
            datasets = require("datasets", "datasets", **_NO_DATASETS)
            rows = [dict(row) for row in datasets.load_dataset(HUB_DATASET, split="test")]
            where = f"{HUB_DATASET} (split test)"
        for number, row in enumerate(rows, 1):
            missing = [key for key in REQUIRED_FIELDS if key not in row]
            if missing:
                raise ValueError(f"{where}: problem {number} lacks field(s) {missing}; need {list(REQUIRED_FIELDS)}")
        ids = [row["unique_id"] for row in rows]
        if len(set(ids)) != len(ids):
            raise ValueError(f"{where}: unique_id values are not unique")
        return rows

    def data_sources(self) -> dict[str, str]:
        if self.data_dir is not None:
            path = Path(self.data_dir) / DATA_FILE
            return {str(path): hashlib.sha256(path.read_bytes()).hexdigest()}
        self.problems()  # loads the whole split once; the hash covers all of it, not just `limit`
        canonical = json.dumps(self._problems, sort_keys=True)
        return {f"{HUB_DATASET}:test": hashlib.sha256(canonical.encode()).hexdigest()}

    # ---- the Task contract ---------------------------------------------------------------------

    def samples(self) -> Iterator[Sample]:
        for problem in self.problems():
            for k in range(self.num_samples):
                yield Sample(
                    id=f"{problem['unique_id']}#{k}",
                    fields={
                        "problem": problem["problem"],
                        "answer": problem["answer"],
                        "unique_id": problem["unique_id"],
                        "subject": problem.get("subject"),
                        "level": problem.get("level"),
                        "sample_index": k,
                    },
                )

    def shard_group(self, sample: Sample) -> str:
        """A problem's sampled responses stay in one shard: they share the problem's prompt (and its prefill)."""
        return sample.fields["unique_id"]

    def build_prompt(self, sample: Sample, tokenizer: Any, max_length: int | None) -> Prompt:
        text = build_user_turn(sample.fields["problem"])
        input_ids = encode_user_turn(tokenizer, text, chat=self.chat_template)
        think_added = self._needs_think_prefix(tokenizer, text)
        if think_added:
            input_ids += list(tokenizer(THINK_START + "\n", add_special_tokens=False)["input_ids"])
        if max_length is not None and len(input_ids) >= max_length:
            raise ValueError(f"{sample.id}: prompt of {len(input_ids)} tokens does not fit max_length={max_length}")
        k = sample.fields["sample_index"]
        generation = GenerationSettings(
            max_new_tokens=self.max_new_tokens,
            do_sample=True,
            temperature=self.temperature,
            top_p=self.top_p,
            seed=sample_seed(self.seed, k),
        )
        info = {
            "unique_id": sample.fields["unique_id"],
            "sample_index": k,
            "subject": sample.fields["subject"],
            "level": sample.fields["level"],
            "think_prefix_added": think_added,
        }
        return Prompt(input_ids=input_ids, generation=generation, info=info)

    def _needs_think_prefix(self, tokenizer: Any, text: str) -> bool:
        if not (self.force_think and self.chat_template and getattr(tokenizer, "chat_template", None)):
            return False
        if THINK_START not in tokenizer.get_vocab():
            return False
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
        )
        return not rendered.rstrip().endswith(THINK_START)

    def score(self, sample: Sample, prediction: str) -> dict[str, float]:
        return score_response(prediction, sample.fields["answer"])

    def summarize(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        """`aggregate(rows)`, plus the same metrics on the rows whose own context exceeded the run's budget
        (`exceeding_budget`) when every row carries the same numeric "budget" (the paper's subset: `ids_exceeding`)."""
        summary = aggregate(rows)
        budgets = {_row_value(row, "budget") for row in rows}
        if len(budgets) == 1 and isinstance(next(iter(budgets)), int):
            budget = next(iter(budgets))
            summary["exceeding_budget"] = {"budget": budget, **aggregate(subset_exceeding(rows, budget))}
        return summary


# The error of the missing 'datasets' extra (keydiff.extras.missing): what needs it, and the way without it.
_NO_DATASETS = dict(what=f"Math500 without task.data_dir (it loads {HUB_DATASET} with the `datasets` package)",
                    otherwise="task.data_dir=<a folder holding test.jsonl in the MATH-500 layout>")


# --- Aggregation over result rows (used by summarize and by the tables script) ---


def _row_value(row: dict[str, Any], key: str) -> Any:
    if key in row:
        return row[key]
    return (row.get("info") or {}).get(key)


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _context_length(row: dict[str, Any]) -> int:
    prompt, new = _row_value(row, "prompt_tokens"), _row_value(row, "new_tokens")
    if prompt is None or new is None:
        raise ValueError(f"row {row.get('sample_id')!r} lacks 'prompt_tokens'/'new_tokens' needed for the subset")
    return int(prompt) + int(new)


def aggregate(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Math-500 metrics of a set of result rows: exact / flex (mean over all rows), exact_std / flex_std (std, n-1,
    of the per-sample-index accuracies), avg_new_tokens, truncation_rate (finish_reason "length"),
    no_answer_rate (no box), n_samples, n_problems; length metrics None when the rows lack the fields."""
    result: dict[str, Any] = {
        "n_samples": len(rows),
        "n_problems": len({problem_id(row["sample_id"]) for row in rows}),
    }
    for metric in ("exact", "flex"):
        result[metric] = _mean([float(row["scores"][metric]) for row in rows])
        by_index: dict[int, list[float]] = {}
        for row in rows:
            by_index.setdefault(sample_index(row["sample_id"]), []).append(float(row["scores"][metric]))
        per_index = [sum(values) / len(values) for values in by_index.values()]
        result[f"{metric}_std"] = statistics.stdev(per_index) if len(per_index) > 1 else None
    has_answer = [float(row["scores"]["has_answer"]) for row in rows if "has_answer" in row["scores"]]
    result["no_answer_rate"] = None if not has_answer else 1.0 - sum(has_answer) / len(has_answer)
    lengths = [float(v) for v in (_row_value(row, "new_tokens") for row in rows) if v is not None]
    result["avg_new_tokens"] = _mean(lengths)
    reasons = [r for r in (_row_value(row, "finish_reason") for row in rows) if r is not None]
    result["truncation_rate"] = _mean([float(reason == "length") for reason in reasons])
    return result


def ids_exceeding(rows: Iterable[dict[str, Any]], budget: int, unit: str = "sample") -> set[str]:
    """Sample ids of the rows whose context (prompt_tokens + new_tokens) exceeds `budget` tokens (Tables 5/7: the
    full-cache run's subset, every method scored on it). `unit`: "sample" (default: eviction is per response),
    "problem_any" (every response of a problem where one exceeds) or "problem_mean" (mean length exceeds)."""
    if unit not in SUBSET_UNITS:
        raise ValueError(f"unit must be one of {list(SUBSET_UNITS)}, got {unit!r}")
    rows = list(rows)
    if unit == "sample":
        return {row["sample_id"] for row in rows if _context_length(row) > budget}
    lengths: dict[str, list[int]] = {}
    for row in rows:
        lengths.setdefault(problem_id(row["sample_id"]), []).append(_context_length(row))
    if unit == "problem_any":
        chosen = {pid for pid, values in lengths.items() if max(values) > budget}
    else:
        chosen = {pid for pid, values in lengths.items() if sum(values) / len(values) > budget}
    return {row["sample_id"] for row in rows if problem_id(row["sample_id"]) in chosen}


def subset_by_ids(rows: Iterable[dict[str, Any]], ids: set[str]) -> list[dict[str, Any]]:
    """The rows whose sample id is in `ids` (e.g. ids chosen on another run with `ids_exceeding`)."""
    return [row for row in rows if row["sample_id"] in ids]


def subset_exceeding(rows: list[dict[str, Any]], budget: int, unit: str = "sample") -> list[dict[str, Any]]:
    """The rows of this run whose own context exceeds `budget` (`unit` as in `ids_exceeding`); the paper's
    subset uses the full-cache run's lengths instead: `subset_by_ids(rows, ids_exceeding(full_rows, budget))`."""
    return subset_by_ids(rows, ids_exceeding(rows, budget, unit))
