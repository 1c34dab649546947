"""Runs at batch_size > 1 (keydiff.run.batched) on the tiny model: out of memory and stop signals inside a batch
lose and duplicate nothing (the rows of batch 1)."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
from pathlib import Path
from typing import Iterator

import pytest
import torch
from omegaconf import OmegaConf, open_dict

from keydiff.decode import scheduler
from keydiff.device import out_of_memory
from keydiff.run import runner
from keydiff.run.preemption import Preempted
from keydiff.run.results import run_dir_of
from tests.conftest import char_tokenizer, out_of_memory_error, tiny_llama
from tests.test_cluster import make_cfg, rows_of

pytestmark = [pytest.mark.integration, pytest.mark.extended]

LENGTHS = [30, 100, 20, 64, 47, 81]  # 20 and 30 < N = 48; six samples through four slots: slots are refilled
SAME = ("prediction", "scores", "prompt_tokens", "budget", "kept_tokens", "new_tokens", "finish_reason",
        "max_cache_entries", "layer_max_cache_entries", "seed", "status")


@pytest.fixture
def tiny(monkeypatch):
    model, tokenizer = tiny_llama("sdpa"), char_tokenizer()
    monkeypatch.setattr(runner, "load_model", lambda cfg: (model, tokenizer))
    monkeypatch.setattr(runner, "_LOADED", {})


def lengths_cfg(tmp_path, name: str, *overrides: str, policy: str = "keydiff"):
    cfg = make_cfg(tmp_path, f"policy={policy}", *overrides, task={"lengths": LENGTHS, "max_new_tokens": 6})
    with open_dict(cfg):
        cfg.experiment_name = name
    return cfg


def math_cfg(tmp_path, name: str, *overrides: str):
    cfg = make_cfg(tmp_path, *overrides)
    with open_dict(cfg):
        cfg.experiment_name = name
        cfg.task = OmegaConf.create({"_target_": "keydiff.tasks.math500.Math500", "name": "math500", "limit": 2,
                                     "data_dir": "tasks/fixtures/math500", "num_samples": 3, "max_new_tokens": 10,
                                     "chat_template": False, "seed": 0})
    return cfg


def by_id(run_dir) -> dict[str, dict]:
    rows = rows_of(Path(run_dir))
    ids = [row["sample_id"] for row in rows]
    assert len(ids) == len(set(ids)), "a sample was written twice"
    return {row["sample_id"]: row for row in rows}


def same_rows(a: dict[str, dict], b: dict[str, dict]) -> None:
    assert sorted(a) == sorted(b)
    for key in a:
        assert {k: a[key].get(k) for k in SAME} == {k: b[key].get(k) for k in SAME}, key


def run_at(cfg):
    summary = runner.run(cfg, run_dir_of(cfg))
    return summary, by_id(summary["run_dir"])


def test_out_of_memory_in_a_batch_step_retries_at_half_the_width(tmp_path, tiny, inject_oom):
    """Memory runs out in a step of four sequences: they start again (a new prefill each) at width 2."""
    _, expected = run_at(lengths_cfg(tmp_path, "b1"))
    injected = inject_oom(lambda active: len(active) == 4 and all(sequence.steps >= 2 for sequence in active),
                          after=True)
    summary, rows = run_at(lengths_cfg(tmp_path, "oom", "batch_size=4"))
    assert injected.raised and summary["complete"] and summary["num_failed"] == 0
    same_rows(expected, rows)
    assert summary["invocations"][-1]["decode_widths"] == [4, 2]
    assert {row["decode_width"] for row in rows.values()} == {2}  # the four in flight at width 4 all started again
    assert all(row["decode_width"] == 1 for row in expected.values())


def test_out_of_memory_in_a_prefill_retries_at_half_the_width(tmp_path, tiny, inject_oom):
    """A prefill that runs out of memory while others decode is started again after the back-off."""
    _, expected = run_at(lengths_cfg(tmp_path, "b1"))
    # len100: the second sample, while len30 decodes
    injected = inject_oom(lambda prompt: len(prompt.input_ids) > 80, at="prefill")
    summary, rows = run_at(lengths_cfg(tmp_path, "oomp", "batch_size=4"))
    assert injected.raised and summary["complete"] and summary["num_failed"] == 0
    assert summary["invocations"][-1]["decode_widths"] == [4, 2]
    same_rows(expected, rows)


@contextlib.contextmanager
def blocks_alive_at_the_back_off() -> Iterator[list[list]]:
    """The slots of every shared arena and every step plan alive when the back-off has built the smaller width."""
    import gc

    from keydiff.decode.plan import StepPlan
    from keydiff.cache.arena import Arena

    alive: list[list[int]] = []

    class Probe(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.getMessage().startswith("out of memory at width"):
                gc.collect()
                objects = gc.get_objects()
                alive.append([a.slots for a in objects if type(a) is Arena and a.shared]
                             + [f"plan W={plan.ids.shape[0]}" for plan in objects if type(plan) is StepPlan])

    logger, probe = logging.getLogger(scheduler.__name__), Probe(logging.WARNING)
    logger.addHandler(probe)
    try:
        yield alive
    finally:
        logger.removeHandler(probe)


def test_the_retry_after_out_of_memory_starts_with_no_block_of_the_failed_batch_alive(tmp_path, tiny, inject_oom):
    """Nothing holds the failed width's arena (no abandoned job's state, no step, no traceback) after the back-off."""
    def pooled(active) -> bool:
        return len([s for s in active if s.cache.stack is not None and s.cache.stack.handle.shared]) >= 2

    step = inject_oom(pooled, after=True)
    with blocks_alive_at_the_back_off() as alive:
        summary, _ = run_at(lengths_cfg(tmp_path, "oompin", "batch_size=4"))
    steps = summary["invocations"][-1]["decode_steps"]
    assert summary["complete"] and step.raised and steps["arenas"][0] == 4 and steps["slot_copies_in"] >= 2
    assert alive == [[]], alive  # the failed batch did pool its samples (above); nothing holds its arena


def test_the_retry_after_out_of_memory_holds_no_fork_not_yet_taken(tmp_path, tiny, inject_oom):
    """Math-500's 3 forks of one prefill at width 2: out of memory while the third waits drops it too."""
    _, expected = run_at(math_cfg(tmp_path, "m1"))
    step = inject_oom(lambda active: len(active) == 2, after=True)
    with blocks_alive_at_the_back_off() as alive:
        summary, rows = run_at(math_cfg(tmp_path, "m2oom", "batch_size=2"))
    assert step.raised and summary["complete"] and alive == [[]], alive
    same_rows(expected, rows)


def test_out_of_memory_down_to_width_one_records_the_sample_as_failed(tmp_path, tiny, inject_oom):
    _, expected = run_at(lengths_cfg(tmp_path, "b1"))
    inject_oom(lambda active: any(sequence.request.key == "len64" for sequence in active), times=None)
    summary, rows = run_at(lengths_cfg(tmp_path, "oom1", "batch_size=2"))
    assert summary["invocations"][-1]["decode_widths"] == [2, 1] and rows["len64"]["status"] == "failed"
    assert rows["len64"]["failure_reason"] == "out_of_memory" and "CUDA out of memory" in rows["len64"]["error"]
    assert summary["num_failed"] == 1 and summary["num_samples"] == len(LENGTHS) - 1
    same_rows({k: v for k, v in expected.items() if k != "len64"}, {k: v for k, v in rows.items() if k != "len64"})


def test_out_of_memory_with_a_plain_request_in_flight_is_raised(inject_oom):
    """generate_batch over prefilled states (not jobs) cannot start them again: the error reaches the caller."""
    import keydiff

    model = tiny_llama("sdpa")
    states = [keydiff.prefill(model, torch.arange(1, 60)[None], keydiff.build_policy("keydiff"), 16, 8)
              for _ in range(2)]
    inject_oom(lambda active: True)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        list(keydiff.generate_batch(model, [keydiff.Request(s, 4, key=i) for i, s in enumerate(states)], 2))


def test_a_stop_signal_in_a_batch_writes_finished_rows_and_the_resume_finishes_the_rest(tmp_path, tiny, monkeypatch):
    """The signal passes through the batch's loop (not reported as the batch's failure), its finished rows kept."""
    _, expected = run_at(lengths_cfg(tmp_path, "b1"))
    real = scheduler.Decoder.generate

    def interrupted(self, requests):
        results = real(self, requests)
        if self.width == 1:  # the warm-up's decoder
            yield from results
            return
        yield next(results)
        yield next(results)
        os.kill(os.getpid(), signal.SIGTERM)  # arrives inside the next step (interruptible)
        yield from results

    monkeypatch.setattr(scheduler.Decoder, "generate", interrupted)
    cfg = lengths_cfg(tmp_path, "stop", "batch_size=4")
    with pytest.raises(Preempted):
        run_at(cfg)
    first = by_id(run_dir_of(cfg))
    assert len(first) == 2
    monkeypatch.setattr(scheduler.Decoder, "generate", real)
    summary, rows = run_at(cfg)
    assert summary["complete"]
    same_rows(expected, rows)
    assert all(rows[key] == first[key] for key in first)  # the rows written before the signal are kept as they were
    stopped, resumed = summary["invocations"]  # each invocation, with the rows it wrote
    assert (stopped["stopped_by"], stopped["rows"], resumed["stopped_by"], resumed["rows"]) == (
        "stopped by SIGTERM", 2, None, len(LENGTHS) - 2)
    assert {rows[key]["invocation"] for key in first} == {stopped["id"]}
    assert summary["stopped_by"] is None


@pytest.mark.unit
@pytest.mark.parametrize("overrides, message", [
    (["batch_size=0"], "batch_size=0 is not valid"),
    (["batch_size=2", "experiment_name=fig7_ttft"], "latency experiments time each sample alone"),
    (["batch_size=4", "experiment_name=fig17_ttft_eager"], "valid: batch_size=1"),
])
def test_bad_batch_sizes_are_refused_before_the_model_loads(tmp_path, monkeypatch, overrides, message):
    monkeypatch.setattr(runner, "load_model", lambda cfg: pytest.fail("loaded the model"))
    with pytest.raises(ValueError, match=message):
        runner.run(make_cfg(tmp_path, *overrides), tmp_path / "run")


def raised_while_handling(first: BaseException, then: BaseException) -> BaseException:
    try:
        try:
            raise first
        except BaseException:
            raise then
    except BaseException as error:
        return error


@pytest.mark.unit
def test_the_one_out_of_memory_rule_reads_an_error_and_what_it_was_raised_from_or_while_handling():
    """An allocator's error, or one raised from or while handling one (a capture's end), is out of memory; no other."""
    assert out_of_memory(out_of_memory_error()) and out_of_memory(MemoryError())
    assert out_of_memory(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 GB"))
    assert out_of_memory(RuntimeError("MPS backend out of memory"))
    capture = RuntimeError("CUDA error: operation failed during capture")
    assert out_of_memory(raised_while_handling(out_of_memory_error(), capture))
    cause = RuntimeError("wrapped")
    cause.__cause__ = MemoryError()
    assert out_of_memory(cause)
    assert not out_of_memory(ValueError("out of memory"))  # not an allocator's error
    assert not out_of_memory(raised_while_handling(KeyError("x"), RuntimeError("index out of range")))
    assert not out_of_memory(None)
