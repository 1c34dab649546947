"""How a run schedules its samples, beyond the tokens each one gets: which samples share a prefill, which shard
takes a sample, what a resumed conversation replays, what an out-of-memory retry keeps, and in what order a
context's questions are asked.

Each test guards against a bug that leaves every prediction the tests compare alone intact, or loses samples
only on a path they never take (issue #29, part 4). They run through `runner.run` on the tiny model (or read
the task), so they hold across a refactor of the batching and scheduling code.
"""

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


# --------------------------------------------------------------------------------- shared prefills



@dataclass
class TwinLengthsTask(LengthsTask):
    """LengthsTask whose samples come in twins: two prompts of one length with different text, one after the other
    (where a batched run looks for samples sharing one prefill)."""

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
    """Consecutive samples share one prefill only if their prompts are the same tokens: twins of one length with
    different text are prefilled each on its own at batch 2 (`prefill_shared` 1) and write batch 1's rows."""
    _, one = run_at(twins_cfg(tmp_path, "twins1"))
    summary, two = run_at(twins_cfg(tmp_path, "twins2", "batch_size=2"))
    assert summary["complete"] and len(two) == 4
    assert one["len64-0"]["prediction"] != one["len64-1"]["prediction"]  # the twins do answer differently
    assert all(row["prefill_shared"] == 1 for row in two.values())
    same_rows(one, two)


# --------------------------------------------------------------------------------- out of memory with forks


@pytest.mark.extended
def test_out_of_memory_with_forks_still_waiting_reruns_them_and_completes(tmp_path, tiny, inject_oom):
    """Math-500, 3 responses per problem sharing one prefill, batch 2: memory runs out at the first step with a
    sequence that joined after the first ones were written (here the first two finish together, so the third
    response and the second problem's first join, its other two forks still waiting). The abandoned ones and the
    waiting forks start again at batch 1, each with a prefill of its own, and the run ends complete with batch 1's
    rows."""
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


# --------------------------------------------------------------------------------- shards


@pytest.mark.extended
def test_a_math500_shard_run_keeps_every_problems_responses_together(tmp_path, tiny):
    """shard=i/2 of Math-500 (2 problems x 3 responses) through the runner: each shard writes whole problems, all
    three responses of each (one prefill serves them), and the two shards cover the six samples once."""
    seen = []
    for index in (1, 2):
        summary, rows = run_at(math_cfg(tmp_path, "mshard", f"shard={index}/2"))
        assert summary["complete"]
        problems = Counter(row["info"]["unique_id"] for row in rows.values())
        assert list(problems.values()) == [3], (index, problems)  # one whole problem per shard
        seen += list(rows)
    assert len(seen) == len(set(seen)) == 6


# --------------------------------------------------------------------------------- resumed conversations


@dataclass
class ToyConversation(ToyShared):
    """tests.test_shared_context.ToyShared as a run's task (query_aware=false needs a task that says where its
    context ends)."""

    context_split: ClassVar[str] = "the first 220 ids"


def toy_cfg(tmp_path, name: str):
    cfg = make_cfg(tmp_path, f"experiment_name={name}", "query_aware=false", "budget.tokens=64", "block_size=32")
    with open_dict(cfg):
        cfg.task = OmegaConf.create({"_target_": "tests.test_run_scheduling.ToyConversation", "name": "toy_shared",
                                     "mode": "multi_turn"})
    return cfg


@pytest.mark.extended
def test_a_resumed_conversation_missing_only_its_last_question_replays_the_earlier_turns(tmp_path, tiny):
    """multi_turn (ToyConversation: a 220-token context, questions of 9, 23 and 40 tokens,
    6-token answers) run whole, then resumed after losing its last row: the resumed run writes that row alone, from
    the whole conversation replayed (220 + 9 + 5 + 25 + 5 + 42 = 306 prompt tokens: an answer's tokens but its last,
    then that token, one id of the turn and the question; not the 260 of the context and the last question alone),
    with the answer of the whole run."""
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


# --------------------------------------------------------------------------------- asking order


@pytest.mark.unit
def test_the_asking_order_of_a_few_contexts_is_pinned():
    """The questions of a context are asked in a shuffle from a stream of its own (ruler_shared.asking_order):
    pinned here for the default task (4K, seed 42) with 4 and 8 questions, so that drawing it from another stream
    (the needle depths', the placement's) or reordering the draws shows up as a change of these orders, which
    would change every multi-turn conversation and every per-rank score."""
    from keydiff.tasks.ruler_shared import RulerShared

    assert [RulerShared(questions=4).asking_order(c) for c in range(3)] == [
        [3, 2, 0, 1], [3, 0, 1, 2], [0, 3, 2, 1]]
    assert [RulerShared(questions=8).asking_order(c) for c in range(3)] == [
        [7, 4, 6, 2, 1, 5, 0, 3], [6, 5, 1, 7, 2, 0, 3, 4], [7, 0, 1, 6, 3, 5, 4, 2]]
    task = RulerShared(questions=4, limit=2)
    assert [s.fields["needle"] for s in task.samples()] == [3, 2, 0, 1, 3, 0, 1, 2]  # the samples follow it
