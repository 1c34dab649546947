"""Runs at batch_size > 1 (keydiff.run.batched) on the tiny model: the same rows as batch 1, Math-500's
responses sharing one prefill, and out-of-memory and stop signals inside a batch losing and duplicating nothing."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf, open_dict

from keydiff.run import batched, runner
from keydiff.run.preemption import Preempted
from keydiff.run.results import run_dir_of
from tests.conftest import char_tokenizer, tiny_llama
from tests.test_cluster import make_cfg, rows_of

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


@pytest.mark.parametrize("policy", ["keydiff", "h2o", "full"])
def test_batch_four_run_writes_the_rows_of_batch_one(tmp_path, tiny, policy):
    one, rows_one = run_at(lengths_cfg(tmp_path, "b1", policy=policy))
    four, rows_four = run_at(lengths_cfg(tmp_path, "b4", "batch_size=4", policy=policy))
    same_rows(rows_one, rows_four)
    assert one["batch_size"] == 1 and four["batch_size"] == 4 and four["complete"]
    assert max(row["decode_batch_size"] for row in rows_four.values()) > 1
    assert all(row["decode_s_per_token"] >= 0 and row["prefill_shared"] == 1 for row in rows_four.values())
    assert json.dumps(one["metrics"]) == json.dumps(four["metrics"])  # same values, same order (sample order)


def test_math500_samples_share_one_prefill_and_equal_separate_runs(tmp_path, tiny):
    one, rows_one = run_at(math_cfg(tmp_path, "m1"))
    three, rows_three = run_at(math_cfg(tmp_path, "m3", "batch_size=3"))
    same_rows(rows_one, rows_three)
    assert len(rows_three) == 6 and all(row["prefill_shared"] == 3 for row in rows_three.values())
    assert json.dumps(one["metrics"]) == json.dumps(three["metrics"])
    assert len({row["seed"] for row in rows_three.values()}) == 3  # one seed per response index, as at batch 1
    problems = {}
    for row in rows_three.values():  # the three responses of a problem share its one prefill (one TTFT)
        problems.setdefault(row["info"]["unique_id"], set()).add(row["ttft_s"])
    assert all(len(times) == 1 for times in problems.values())
    assert len({row["prediction"] for row in rows_three.values()}) > 2  # the seeds really differ


def test_out_of_memory_in_a_batch_retries_at_half_the_batch(tmp_path, tiny, monkeypatch):
    _, expected = run_at(lengths_cfg(tmp_path, "b1"))
    real = batched.generate_batch
    sizes, raised = [], []

    def flaky(model, requests, batch_size, **options):  # options: batch_invariant
        sizes.append(batch_size)
        results = real(model, requests, batch_size, **options)
        yield next(results)
        if batch_size > 1 and len(raised) < 1:
            raised.append(True)
            next(results)  # the step runs, then memory "runs out" mid-batch
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        yield from results

    monkeypatch.setattr(batched, "generate_batch", flaky)
    summary, rows = run_at(lengths_cfg(tmp_path, "oom", "batch_size=4"))
    assert sizes == [4, 2] and summary["complete"] and summary["num_failed"] == 0
    same_rows(expected, rows)


def test_the_retry_after_out_of_memory_starts_with_no_block_of_the_failed_batch_alive(tmp_path, tiny, monkeypatch):
    """A pooled sample's cache is a view of its batch's whole block (blocks.JoinPool): the runner must hold no
    finished sample's state when it retries at half the batch, or the old block stays allocated beside the new
    one, which is the memory the retry is meant to free."""
    import gc

    from keydiff.batching.blocks import JoinPool, RowBlock

    real = batched.generate_batch
    alive, raised = [], []

    def flaky(model, requests, batch_size, **options):  # options: batch_invariant
        if raised:  # the retry starts: which blocks does the failed batch still hold?
            gc.collect()
            alive.append([o.keys.shape[0] for o in gc.get_objects() if type(o) is RowBlock])
        results = real(model, requests, batch_size, **options)
        yield next(results)
        if batch_size > 1 and not raised:
            yield next(results)  # the second sample to finish is a pooled one
            raised.append(True)
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        yield from results

    monkeypatch.setattr(batched, "generate_batch", flaky)
    pooled = []
    original_place = JoinPool.place

    def place(self, cache):
        placed = original_place(self, cache)
        pooled.append(placed)
        return placed

    monkeypatch.setattr(JoinPool, "place", place)
    summary, _ = run_at(lengths_cfg(tmp_path, "oompin", "batch_size=4"))
    assert summary["complete"] and any(pooled)  # the failed batch did pool its samples
    assert alive == [[]], alive


def test_out_of_memory_down_to_batch_one_records_the_sample_as_failed(tmp_path, tiny, monkeypatch):
    real = batched.generate_batch
    sizes = []

    def always(model, requests, batch_size, **options):  # options: batch_invariant
        sizes.append(batch_size)
        for key, out in real(model, requests, batch_size, **options):
            if key == "len64":
                raise torch.cuda.OutOfMemoryError("CUDA out of memory")
            yield key, out

    monkeypatch.setattr(batched, "generate_batch", always)
    summary, rows = run_at(lengths_cfg(tmp_path, "oom1", "batch_size=2"))
    assert sizes[:2] == [2, 1] and rows["len64"]["status"] == "failed"
    assert rows["len64"]["failure_reason"] == "out_of_memory"
    assert summary["num_failed"] == 1 and summary["num_samples"] == len(LENGTHS) - 1


def test_a_stop_signal_in_a_batch_writes_finished_rows_and_the_resume_finishes_the_rest(tmp_path, tiny, monkeypatch):
    _, expected = run_at(lengths_cfg(tmp_path, "b1"))
    real = batched.generate_batch

    def interrupted(model, requests, batch_size, **options):  # options: batch_invariant
        results = real(model, requests, batch_size, **options)
        yield next(results)
        yield next(results)
        os.kill(os.getpid(), signal.SIGTERM)  # arrives inside the next step (interruptible)
        yield from results

    monkeypatch.setattr(batched, "generate_batch", interrupted)
    cfg = lengths_cfg(tmp_path, "stop", "batch_size=4")
    with pytest.raises(Preempted):
        run_at(cfg)
    first = by_id(run_dir_of(cfg))
    assert len(first) == 2
    monkeypatch.setattr(batched, "generate_batch", real)
    summary, rows = run_at(cfg)
    assert summary["complete"]
    same_rows(expected, rows)
    assert all(rows[key] == first[key] for key in first)  # the rows written before the signal are kept as they were
    stopped, resumed = summary["invocations"]  # each invocation, with the rows it wrote
    assert (stopped["stopped_by"], stopped["rows"], resumed["stopped_by"], resumed["rows"]) == (
        "stopped by SIGTERM", 2, None, len(LENGTHS) - 2)
    assert {rows[key]["invocation"] for key in first} == {stopped["id"]} and summary["stopped_by"] is None


@pytest.mark.parametrize("overrides, message", [
    (["batch_size=0"], "batch_size=0 is not valid"),
    (["batch_size=2", "experiment_name=fig7_ttft"], "latency experiments time each sample alone"),
    (["batch_size=4", "experiment_name=fig17_ttft_eager"], "valid: batch_size=1"),
])
def test_bad_batch_sizes_are_refused_before_the_model_loads(tmp_path, monkeypatch, overrides, message):
    monkeypatch.setattr(runner, "load_model", lambda cfg: pytest.fail("loaded the model"))
    with pytest.raises(ValueError, match=message):
        runner.run(make_cfg(tmp_path, *overrides), tmp_path / "run")
