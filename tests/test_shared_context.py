"""Several questions over one compressed context (keydiff.run.shared, keydiff.tasks.ruler_shared): each question
of multi_request sees a fresh compression and equals the independent query-agnostic run; resumes, the task's data,
and the one-line errors."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator

import pytest
import torch

from keydiff import build_policy, generate, prefill
from keydiff.models import ModelConfig
from keydiff.run import runner
from keydiff.run.plan import RunPlan
from keydiff.run.samples import RunContext, run_sample
from keydiff.run.shared import answer
from keydiff.tasks.base import GenerationSettings, Prompt, Sample, SharedContext, Task
from tests.conftest import CORE_POLICIES, char_tokenizer, extended_unless
from tests.test_runner import make_cfg

pytestmark = pytest.mark.integration

CONTEXT, BUDGET, BLOCK, NEW = 220, 64, 32, 6


class IdTokenizer:
    """Enough of a tokenizer for the runner's rows: ids decode to their numbers."""

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


@dataclass
class ToyShared(Task):
    """One random context and k random questions (ids), with follow-up turns of their own length."""

    name: str = "toy_shared"
    mode: str = "multi_request"
    questions: int = 3
    lengths: list[int] = field(default_factory=lambda: [9, 23, 40])
    seed: int = 7

    def samples(self) -> Iterator[Sample]:
        for j in range(self.questions):
            yield Sample(id=f"c0/q{j}", fields={"question": j})

    def shard_group(self, sample: Sample) -> str:
        return "c0"

    def _ids(self):
        generator = torch.Generator().manual_seed(self.seed)
        context = torch.randint(2, 256, (CONTEXT,), generator=generator).tolist()
        questions = [torch.randint(2, 256, (n,), generator=generator).tolist() for n in self.lengths[: self.questions]]
        return context, questions

    def build_prompt(self, sample: Sample, tokenizer: Any, max_length: int | None, query_aware: bool = True) -> Prompt:
        context, questions = self._ids()
        question = questions[sample.fields["question"]]
        # stop ids masked until NEW tokens: every answer has NEW tokens, so the cache sizes are known
        settings = GenerationSettings(max_new_tokens=NEW, min_new_tokens=NEW)
        return Prompt(context + question, settings, {"question_index": sample.fields["question"]},
                      context_tokens=None if query_aware else len(context))

    def shared_context(self, samples, tokenizer, max_length) -> SharedContext:
        prompts = [self.build_prompt(s, tokenizer, max_length, query_aware=False) for s in samples]
        _, questions = self._ids()
        return SharedContext(prompts[0].input_ids[:CONTEXT], prompts, [[1] + q for q in questions])

    def score(self, sample: Sample, prediction: str) -> dict[str, float]:
        return {"score": 0.0}


ADAKV = {"head_budgets": "adakv", "window": 8}  # "adakv_snapkv" below


def plan_of(task: Task, name: str = "keydiff", evict: bool = True) -> RunPlan:
    name, params = ("snapkv", ADAKV) if name == "adakv_snapkv" else (name, {})
    return RunPlan(name, params, BUDGET, BLOCK, "fast", evict, task, ModelConfig(max_length=None), query_aware=False)


def ctx_of(plan: RunPlan, model) -> RunContext:
    """The run context these tests run under: the id tokenizer, stop id 0, seed 0, code "test"."""
    return RunContext(plan, model, IdTokenizer(), [0], "test")


def run_shared(model, task, plan, before=None):
    samples = list(task.samples())
    shared = task.shared_context(samples, None, None)
    return answer(ctx_of(plan, model), samples, shared, {s.id for s in samples}, before)


def snapshot(state) -> tuple:
    """Everything a question could read of a state: tokens seen, per layer the held positions and values."""
    layers = [layer.held_entries() for layer in state.cache.layers]
    return state.cache.get_seq_length(), [(p.clone(), v.clone()) for p, v in layers]


@pytest.mark.parametrize("name", extended_unless(["keydiff", "snapkv", "tova", "h2o", "knorm", "adakv_snapkv"],
                                                 lambda name: name in CORE_POLICIES))
@pytest.mark.parametrize("evict", [True, False])
def test_multi_request_feeds_every_question_the_freshly_compressed_context(model, name, evict):
    """Each question is fed exactly a fresh compression of the context; its row equals the independent run's."""
    task = ToyShared()
    plan = plan_of(task, name, evict=evict)
    context_ids = task.shared_context(list(task.samples()), None, None).context_ids
    policy = build_policy("snapkv", **ADAKV) if name == "adakv_snapkv" else build_policy(name)
    fresh = snapshot(prefill(model, torch.tensor([context_ids]), policy, BUDGET, BLOCK))
    seen = []

    def before(j, state):
        now = snapshot(state)
        assert now[0] == fresh[0] == CONTEXT, (name, j)
        for (p, v), (fp, fv) in zip(now[1], fresh[1]):
            assert torch.equal(p, fp) and torch.equal(v, fv), (name, j)
            assert int(p.max()) < CONTEXT  # no position of a question or an answer
        seen.append(j)

    rows = run_shared(model, task, plan, before)
    assert seen == [0, 1, 2] and [r["sample_id"] for r in rows] == ["c0/q0", "c0/q1", "c0/q2"]
    independent = plan_of(ToyShared(mode="independent"), name, evict=evict)
    for sample, row in zip(task.samples(), rows):
        alone = run_sample(ctx_of(independent, model), sample,
                           prompt=task.build_prompt(sample, None, None, query_aware=False))
        for key in ("prediction", "prompt_tokens", "context_tokens", "held_tokens", "kept_tokens", "budget",
                    "kept_ratio", "max_cache_entries", "new_tokens", "degenerate"):
            assert row[key] == alone[key], (name, sample.id, key)
        assert row["context_mode"] == "multi_request" and row["ttft_s"] <= alone["ttft_s"] + row["context_prefill_s"]


@pytest.mark.parametrize("mode", ["multi_request", "multi_turn"])
def test_a_resumed_context_writes_only_its_missing_questions_and_the_same_answers(model, mode):
    """Only the missing questions are written, with the answers of a whole run (multi_turn replays the turns)."""
    task = ToyShared(mode=mode)
    samples = list(task.samples())
    shared = task.shared_context(samples, None, None)
    whole = answer(ctx_of(plan_of(task), model), samples, shared, {s.id for s in samples})
    missing = answer(ctx_of(plan_of(task), model), samples, shared, {"c0/q2"})
    assert [r["sample_id"] for r in missing] == ["c0/q2"] and missing[0]["prediction"] == whole[2]["prediction"]
    assert missing[0]["shared_prefill_s"] == missing[0]["context_prefill_s"] > 0  # the context's prefill, counted once


def test_follow_up_refuses_an_undecoded_state_and_feed_and_copy_a_decoded_one(model, prompt):
    from keydiff import copy_state, feed, follow_up

    state = prefill(model, prompt[:, :100], "keydiff", BUDGET, BLOCK)
    with pytest.raises(RuntimeError, match="continues a decoded state"):
        follow_up(model, state, prompt[:, 100:110])
    generate(model, state, 3)
    for call in (lambda: feed(model, state, prompt[:, 100:110]), lambda: copy_state(state, model)):
        with pytest.raises(RuntimeError, match="already decoded"):  # a decoded cache holds one answer already
            call()
    turn = follow_up(model, state, prompt[:, 100:110])
    assert turn.held_suffix == 10 and state.cache is None and not turn.decoded


CHATML = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
          "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def shared_task(**overrides):
    from keydiff.tasks.ruler_shared import RulerShared

    return RulerShared(**{"length": 1500, "questions": 4, "num_contexts": 3, **overrides})


def text(tokenizer, ids) -> str:
    """The characters of a char tokenizer's ids (its decode puts spaces between tokens)."""
    return "".join(tokenizer.convert_ids_to_tokens(ids))


@pytest.mark.unit
@pytest.mark.extended
@pytest.mark.parametrize("template, haystack", [(None, "noise"), (CHATML, "essay")])
def test_task_is_deterministic_and_each_answer_is_in_its_context_once(template, haystack):
    tokenizer = char_tokenizer(template)
    task, again = shared_task(haystack=haystack), shared_task(haystack=haystack)
    task.validate()
    group = [s for s in task.samples() if s.fields["context"] == 1]
    assert {task.shard_group(s) for s in group} == {"c1"}  # a context's questions share its prefill
    shared = task.shared_context(group, tokenizer, None)
    assert shared == again.shared_context([s for s in again.samples() if s.fields["context"] == 1], tokenizer, None)
    context, values = text(tokenizer, shared.context_ids), [s.fields["answers"][0] for s in group]
    for sample, prompt in zip(group, shared.questions):
        assert context.count(sample.fields["answers"][0]) == 1 and context.count(sample.fields["key"]) == 1
        assert prompt == task.build_prompt(sample, tokenizer, None, query_aware=False)
        assert task.build_prompt(sample, tokenizer, None).context_tokens is None
    assert task.score(group[0], f" {values[0]}.") == {"score": 1.0}
    assert task.score(group[0], f" {values[1]}.") == {"score": 0.0}
    assert task.data_sources() == again.data_sources() and len(task.data_sources()) > 1  # summary.json's "data"


@pytest.mark.unit
def test_a_multi_turn_conversation_over_max_length_is_refused_in_one_line():
    """The exact count once tokenized is refused one token over, accepted at the limit; multi_request never."""
    tokenizer = char_tokenizer(CHATML)
    task = shared_task(mode="multi_turn")  # length 1500, k = 4, 128 tokens to generate
    task.check_model(1500 + 3 * 128)
    samples = [s for s in task.samples() if s.fields["context"] == 0]
    shared = task.shared_context(samples, tokenizer, None)
    longest = len(shared.questions[0].input_ids) + sum(len(f) for f in shared.follow_ups[1:]) + 4 * 128
    assert longest > 1500 + 3 * 128
    assert task.shared_context(samples, tokenizer, longest) == shared
    with pytest.raises(ValueError, match=rf"conversation of 4 questions can reach {longest} tokens .*over "
                                         rf"model.max_length={longest - 1}; use fewer task.questions, a shorter "
                                         r"task.length or a larger model.max_length") as error:
        task.shared_context(samples, tokenizer, longest - 1)
    assert "\n" not in str(error.value)
    request = shared_task(mode="multi_request")
    request.shared_context([s for s in request.samples() if s.fields["context"] == 0], tokenizer, longest - 1)


@pytest.mark.unit
def test_summary_averages_per_asking_rank_and_per_depth_rank():
    task = shared_task(questions=2)
    rows = [{"scores": {"score": s}, "info": {"question_index": j, "depth_rank": d, "context_id": c}}
            for c, (j, d, s) in enumerate([(0, 1, 1.0), (1, 0, 0.0), (0, 0, 1.0), (1, 1, 1.0)])]
    summary = task.summarize(rows)
    assert summary["score"] == 0.75 and summary["n"] == 4 and "by_question" not in summary
    assert (summary["contexts"], summary["questions"], summary["mode"]) == (4, 2, task.mode)
    assert summary["by_ask_rank"] == {"0": 1.0, "1": 0.5} and summary["by_depth_rank"] == {"0": 0.5, "1": 1.0}


@pytest.fixture
def no_model_load(monkeypatch):
    monkeypatch.setattr(runner, "load_model", lambda *a, **k: (_ for _ in ()).throw(AssertionError("model loaded")))


@pytest.mark.unit
@pytest.mark.extended
@pytest.mark.parametrize("overrides, message", [
    (["task.mode=chat"], r"task.mode='chat' is not valid; valid: independent, multi_request, multi_turn"),
    (["task.mode=multi_request"],
     r"query_aware=true is not valid with task.mode=multi_request.*valid: query_aware=false"),
    (["task.mode=multi_turn", "query_aware=false", "batch_size=4"],
     r"batch_size=4 is not valid with task.mode=multi_turn"),
    (["task.questions=0"], r"task.questions=0 is not valid; valid: a positive integer"),
    (["task.mode=multi_turn", "query_aware=false", "task.questions=8", "model.max_length=4500"],
     r"multi-turn conversation of task.questions=8 can reach 4992 tokens before its follow-up turns "
     r"\(task.length=4096 \+ 7 more answers x 128 new tokens\), over model.max_length=4500; use fewer task.questions, "
     r"a shorter task.length or a larger model.max_length"),
])
def test_bad_settings_are_one_line_before_the_model_loads(no_model_load, tmp_path, overrides, message):
    cfg = make_cfg("task=shared_ruler_4k", *overrides)
    with pytest.raises(ValueError, match=message) as error:
        runner.run(cfg, tmp_path / "run")
    assert "\n" not in str(error.value) and not (tmp_path / "run").exists()
