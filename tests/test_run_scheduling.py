"""How a run schedules its samples, through runner.run on the tiny model: which samples share a prefill, which shard
takes a sample, what a resumed conversation replays, what an out-of-memory retry keeps, the order of the questions.
Each catches a bug that leaves the tokens the other tests compare intact."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import pytest
from omegaconf import OmegaConf, open_dict

from keydiff.run.results import PREDICTIONS
from keydiff.tasks.base import Prompt, Sample
from tests.conftest import LengthsTask
from tests.test_batched_runs import math_cfg, run_at, same_rows, tiny  # noqa: F401  (tiny: the fixture)
from tests.test_cluster import make_cfg
from tests.test_shared_context import ToyShared

pytestmark = pytest.mark.integration


@dataclass
class TwinLengthsTask(LengthsTask):
    """Samples in twins: two prompts of one length with different text, one after the other."""

    def samples(self):
        for length in self.lengths[: self.limit]:
            for twin in (0, 1):
                yield Sample(id=f"len{length}-{twin}", fields={"length": int(length), "twin": twin})

    def build_prompt(self, sample: Sample, tokenizer, max_length) -> Prompt:
        prompt = super().build_prompt(sample, tokenizer, max_length)
        length, twin = sample.fields["length"], sample.fields["twin"]
        text = "".join(chr(33 + (7 * i + length + 11 * twin) % 90) for i in range(length - 1))
        prompt.input_ids = list(tokenizer(text)["input_ids"])
        return prompt


def twins_cfg(tmp_path, name: str, *overrides: str):
    return make_cfg(tmp_path, f"experiment_name={name}", *overrides,
                    task={"_target_": "tests.test_run_scheduling.TwinLengthsTask", "lengths": [64, 30],
                          "max_new_tokens": 6})


@pytest.mark.extended
def test_prompts_of_equal_length_but_other_tokens_never_share_a_prefill(tmp_path, tiny):
    """Twins of one length but other text are prefilled each alone at batch 2 and write batch 1's rows."""
    _, one = run_at(twins_cfg(tmp_path, "twins1"))
    summary, two = run_at(twins_cfg(tmp_path, "twins2", "batch_size=2"))
    assert summary["complete"] and len(two) == 4
    assert one["len64-0"]["prediction"] != one["len64-1"]["prediction"]  # the twins do answer differently
    assert all(row["prefill_shared"] == 1 for row in two.values())
    same_rows(one, two)


@pytest.mark.extended
def test_out_of_memory_with_forks_still_waiting_reruns_them_and_completes(tmp_path, tiny, inject_oom):
    """Math-500 at batch 2, memory out once a third response joins (its forks waiting): all rerun alone, complete."""
    _, expected = run_at(math_cfg(tmp_path, "m1"))
    seen = set()

    def joined(active) -> bool:
        keys = {sequence.request.key for sequence in active} - {None}  # None: the warm-up's sequence
        if seen and keys - seen:  # the third response joined: the first was written
            return True
        seen.update(keys)
        return False

    injected = inject_oom(joined)
    summary, rows = run_at(math_cfg(tmp_path, "moom", "batch_size=2"))
    assert injected.raised and summary["invocations"][-1]["decode_widths"] == [2, 1]
    assert summary["complete"] and summary["num_failed"] == 0 and len(rows) == 6
    same_rows(expected, rows)
    # The first two responses were written from the shared prefill; the third and the second problem's three
    # (one abandoned, two forks dropped while waiting) were prefilled each alone.
    shared = {key: row["prefill_shared"] for key, row in rows.items()}
    assert sorted(shared.values()) == [1, 1, 1, 1, 3, 3], shared


@pytest.mark.extended
def test_a_math500_shard_run_keeps_every_problems_responses_together(tmp_path, tiny):
    """shard=i/2 of Math-500 (2 problems x 3 responses): each shard writes whole problems, together every sample."""
    seen = []
    for index in (1, 2):
        summary, rows = run_at(math_cfg(tmp_path, "mshard", f"shard={index}/2"))
        assert summary["complete"]
        problems = Counter(row["info"]["unique_id"] for row in rows.values())
        assert list(problems.values()) == [3], (index, problems)  # one whole problem per shard
        seen += list(rows)
    assert len(seen) == len(set(seen)) == 6


@dataclass
class ToyConversation(ToyShared):
    """ToyShared as a run's task (query_aware=false needs a task that says where its context ends)."""

    context_split: ClassVar[str] = "the first 220 ids"


def toy_cfg(tmp_path, name: str):
    cfg = make_cfg(tmp_path, f"experiment_name={name}", "query_aware=false", "budget.tokens=64", "block_size=32")
    with open_dict(cfg):
        cfg.task = OmegaConf.create({"_target_": "tests.test_run_scheduling.ToyConversation", "name": "toy_shared",
                                     "mode": "multi_turn"})
    return cfg


@pytest.mark.extended
def test_a_resumed_conversation_missing_only_its_last_question_replays_the_earlier_turns(tmp_path, tiny):
    """multi_turn resumed after losing its last row: that row alone, from the whole conversation replayed."""
    # 220 context + 9 + 5 + 25 + 5 + 42 = 306 prompt tokens (an answer but its last token, that token, the turn's id
    # and the question), not 260 (the context and the last question alone)
    cfg = toy_cfg(tmp_path, "turns")
    summary, whole = run_at(cfg)
    assert summary["complete"] and [whole[f"c0/q{j}"]["prompt_tokens"] for j in range(3)] == [229, 259, 306]
    path = Path(summary["run_dir"]) / PREDICTIONS
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(line for line in lines if '"c0/q2"' not in line))  # as if the run stopped before it
    summary, resumed = run_at(cfg)
    assert summary["complete"] and sorted(resumed) == ["c0/q0", "c0/q1", "c0/q2"]
    assert resumed["c0/q2"]["prompt_tokens"] == 306 and resumed["c0/q2"]["held_tokens"] == 42
    assert resumed["c0/q2"]["prediction"] == whole["c0/q2"]["prediction"]
    assert {k: resumed[k] for k in ("c0/q0", "c0/q1")} == {k: whole[k] for k in ("c0/q0", "c0/q1")}


@pytest.mark.unit
def test_the_asking_order_of_a_few_contexts_is_pinned():
    """ruler_shared.asking_order pinned (4K, seed 42): another stream would change every multi-turn conversation."""
    from keydiff.tasks.ruler_shared import RulerShared

    assert [RulerShared(questions=4).asking_order(c) for c in range(3)] == [
        [3, 2, 0, 1], [3, 0, 1, 2], [0, 3, 2, 1]]
    assert [RulerShared(questions=8).asking_order(c) for c in range(3)] == [
        [7, 4, 6, 2, 1, 5, 0, 3], [6, 5, 1, 7, 2, 0, 3, 4], [7, 0, 1, 6, 3, 5, 4, 2]]
    task = RulerShared(questions=4, limit=2)
    assert [s.fields["needle"] for s in task.samples()] == [3, 2, 0, 1, 3, 0, 1, 2]  # the samples follow it
