"""Sweeps that survive a cluster (tiny random model): a subset run refused, failure rows, full disk, lock, signals."""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import threading
import time
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf, open_dict

from keydiff.run import runner, samples
from keydiff.run.preemption import Preempted, StopSignals
from keydiff.run.lock import RunLock, RunLockedError
from keydiff.run.results import ConfigMismatchError, ResultStore, ResultWriteError
from tests.conftest import char_tokenizer, tiny_llama

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]


def make_cfg(tmp_path, *overrides: str, task: dict | None = None):
    """A run of tests.conftest.LengthsTask (prompts of 30 and 100 tokens) on the tiny model."""
    model_dir = tmp_path / "tiny-model"
    model_dir.mkdir(exist_ok=True)
    (model_dir / "config.json").write_text("{}")  # model=custom checks for a checkpoint folder
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["model=custom", f"model.path={model_dir}", "model.dtype=float32",
                                           "model.device=cpu", "model.max_length=4096", "policy=keydiff",
                                           "budget.tokens=48", "block_size=16", f"results_root={tmp_path / 'runs'}",
                                           *overrides])
    with open_dict(cfg):
        cfg.task = OmegaConf.create({"_target_": "tests.conftest.LengthsTask", "name": "guard_lengths",
                                     "lengths": [30, 100], "max_new_tokens": 4, "limit": None, **(task or {})})
    return cfg


@pytest.fixture
def tiny(monkeypatch):
    """runner.run on the tiny model; `calls` lists the sample ids run_sample was called with."""
    model, tokenizer = tiny_llama("sdpa"), char_tokenizer()
    monkeypatch.setattr(runner, "load_model", lambda cfg: (model, tokenizer))
    monkeypatch.setattr(runner, "_LOADED", {})
    calls: list[str] = []
    real = samples.run_sample

    def counting(ctx, sample, *args, **kwargs):
        calls.append(sample.id)
        return real(ctx, sample, *args, **kwargs)

    monkeypatch.setattr(samples, "run_sample", counting)
    return calls


def rows_of(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "predictions.jsonl").read_text().splitlines()]


def inject(monkeypatch, failures: dict[str, BaseException]):
    """Make run_sample raise the given error once for the given sample id."""
    real = samples.run_sample

    def failing(ctx, sample, *args, **kwargs):
        if sample.id in failures:
            raise failures.pop(sample.id)
        return real(ctx, sample, *args, **kwargs)

    monkeypatch.setattr(samples, "run_sample", failing)


@pytest.mark.integration
@pytest.mark.extended
def test_a_subset_run_is_refused_in_the_full_runs_directory_and_a_larger_limit_extends(tmp_path, tiny):
    runner.run(make_cfg(tmp_path), tmp_path / "run")
    rows = rows_of(tmp_path / "run")
    with pytest.raises(ConfigMismatchError, match="task.limit=None"):  # it would rewrite the full run's summary
        runner.run(make_cfg(tmp_path, task={"limit": 1}), tmp_path / "run")
    assert rows_of(tmp_path / "run") == rows
    runner.run(make_cfg(tmp_path, task={"limit": 1}), tmp_path / "subset")
    tiny.clear()
    extended = runner.run(make_cfg(tmp_path), tmp_path / "subset")  # a larger limit extends: the missing sample runs
    assert tiny == ["len100"]
    assert extended["num_samples"] == 2 and extended["limit"] is None


@pytest.mark.integration
@pytest.mark.extended
def test_out_of_memory_sample_is_recorded_skipped_on_rerun_and_retried_on_request(tmp_path, tiny, monkeypatch):
    released = []
    monkeypatch.setattr(samples, "release_memory", lambda: released.append(True))
    inject(monkeypatch, {"len100": torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")})
    run_dir = tmp_path / "run"
    summary = runner.run(make_cfg(tmp_path), run_dir)
    ok, failed = rows_of(run_dir)
    assert ok["status"] == "ok" and ok["sample_id"] == "len30"
    assert failed["status"] == "failed" and failed["failure_reason"] == "out_of_memory"
    assert failed["prompt_tokens"] == 100 and "Tried to allocate" in failed["error"] and "scores" not in failed
    assert released == [True]  # memory released before the next sample
    assert summary["complete"] and summary["num_samples"] == 1 and summary["num_failed"] == 1
    assert summary["failures"] == {"out_of_memory": 1} and summary["statistics"]["samples"] == 1

    # A re-run does not retry the recorded failure (the model is not even needed).
    tiny.clear()
    loader = runner.load_model
    monkeypatch.setattr(runner, "load_model", lambda cfg: pytest.fail("loaded the model with nothing to do"))
    monkeypatch.setattr(runner, "_LOADED", {})
    assert runner.run(make_cfg(tmp_path), run_dir)["num_failed"] == 1 and tiny == []

    # retry_failed=true runs it again; the failed row stays in the file as history, the summary uses the new row.
    monkeypatch.setattr(runner, "load_model", loader)
    retried = runner.run(make_cfg(tmp_path, "retry_failed=true"), run_dir)
    rows = rows_of(run_dir)
    assert [r["sample_id"] for r in rows] == ["len30", "len100", "len100"] and rows[2]["status"] == "ok"
    assert retried["num_samples"] == 2 and retried["num_failed"] == 0 and retried["failures"] == {}


@pytest.mark.integration
@pytest.mark.extended
def test_a_prompt_over_max_prompt_tokens_is_a_failed_row_that_never_reaches_the_model(tmp_path, tiny):
    at_cap = runner.run(make_cfg(tmp_path, "max_prompt_tokens=100"), tmp_path / "at")
    assert tiny == ["len30", "len100"] and at_cap["failures"] == {} and at_cap["num_samples"] == 2
    tiny.clear()
    below = runner.run(make_cfg(tmp_path, "max_prompt_tokens=99"), tmp_path / "below")
    assert tiny == ["len30"] and below["failures"] == {"max_prompt_tokens": 1} and below["max_prompt_tokens"] == 99
    capped = rows_of(tmp_path / "below")[1]
    assert capped["failure_reason"] == "max_prompt_tokens" and capped["prompt_tokens"] == 100
    assert capped["error"] == "prompt has 100 tokens > max_prompt_tokens=99"


@pytest.mark.integration
@pytest.mark.extended
def test_any_other_error_stops_the_run_naming_the_sample(tmp_path, tiny, monkeypatch):
    inject(monkeypatch, {"len100": IndexError("index 7 is out of bounds")})
    with pytest.raises(RuntimeError, match="sample 'len100' failed with IndexError: index 7"):
        runner.run(make_cfg(tmp_path), tmp_path / "run")
    assert [r["sample_id"] for r in rows_of(tmp_path / "run")] == ["len30"]  # written rows are kept


@pytest.mark.integration
@pytest.mark.extended
def test_full_disk_stops_without_corrupting_what_was_written(tmp_path, tiny, monkeypatch):
    import keydiff.run.results as results

    real_write, writes = os.write, []

    def disk_full_on_second_row(fd, data):
        writes.append(len(data))
        if len(writes) == 2:
            real_write(fd, data[: len(data) // 2])  # half a line reaches the disk, then it is full
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(results.os, "write", disk_full_on_second_row)
    run_dir = tmp_path / "run"
    with pytest.raises(ResultWriteError, match="No space left on device.*1 rows written before are intact"):
        runner.run(make_cfg(tmp_path), run_dir)
    text = (run_dir / "predictions.jsonl").read_text()
    assert text.endswith("\n") and [json.loads(line)["sample_id"] for line in text.splitlines()] == ["len30"]

    monkeypatch.setattr(results.os, "write", real_write)
    assert runner.run(make_cfg(tmp_path), run_dir)["num_samples"] == 2
    summary_before = (run_dir / "summary.json").read_text()

    def no_space(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(results.os, "fsync", no_space)
    with pytest.raises(ResultWriteError, match="previous version is intact"):
        ResultStore(run_dir, json.loads((run_dir / "run_config.json").read_text())).write_summary({"x": 1})
    assert (run_dir / "summary.json").read_text() == summary_before
    assert not list(run_dir.glob(".*.tmp"))


DEAD_PID = 2**22 + 1  # above Linux's largest pid_max: never a live process


def test_second_writer_is_refused_naming_the_holder_and_may_wait(tmp_path):
    """Refused naming the holder; with lock_wait it waits, leaves the live lock alone, then takes it."""

    class WatchedLock(RunLock):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.saw_holder = threading.Event()

        def holder(self):
            found = super().holder()
            if found and found != self.record:
                self.saw_holder.set()
            return found

    lock = tmp_path / "run" / ".lock"
    lock.parent.mkdir()
    live = {"host": socket.gethostname(), "pid": os.getppid(), "started": "now"}  # another live process
    lock.write_text(json.dumps(live))
    with pytest.raises(RunLockedError, match=f"host {socket.gethostname()}, pid {os.getppid()}, since now"):
        RunLock(tmp_path / "run").acquire()
    waiter = WatchedLock(tmp_path / "run", wait_s=30, poll_s=0.01)
    errors: list[BaseException] = []

    def wait_for_lock():
        try:
            waiter.acquire()
        except BaseException as error:  # reported below, in the test's thread
            errors.append(error)

    thread = threading.Thread(target=wait_for_lock)
    thread.start()
    assert waiter.saw_holder.wait(timeout=30), "the waiter never looked at the lock"
    assert json.loads(lock.read_text()) == live  # it waits: the live holder's lock is untouched
    lock.unlink()  # the holder finishes
    thread.join(timeout=30)
    assert not thread.is_alive(), "the waiter did not take the released lock"
    assert errors == [] and json.loads(lock.read_text()) == waiter.record
    with pytest.raises(RunLockedError, match="locked by this process already"):  # a run is locked once
        RunLock(tmp_path / "run").acquire()
    assert json.loads(lock.read_text()) == waiter.record  # the refused second taker left the lock alone
    waiter.release()
    assert not lock.exists()
    # A lock from another host cannot be checked from here: refused, not stolen.
    lock.write_text(json.dumps({"host": "node-elsewhere", "pid": DEAD_PID, "started": "earlier"}))
    with pytest.raises(RunLockedError, match="host node-elsewhere"):
        RunLock(tmp_path / "run").acquire()


@pytest.mark.parametrize("pid", [os.getpid(), DEAD_PID], ids=["this-pid-not-held", "dead"])
def test_a_stale_lock_of_this_host_is_taken_over(tmp_path, pid):
    """A dead pid, or this pid while this process holds no lock (a restarted container): taken over."""
    lock = tmp_path / "run" / ".lock"
    lock.parent.mkdir()
    lock.write_text(json.dumps({"host": socket.gethostname(), "pid": pid, "started": "before a restart"}))
    with RunLock(tmp_path / "run") as taken:
        assert json.loads(lock.read_text()) == taken.record
    assert not lock.exists()


def test_a_signal_abandons_interruptible_work_and_waits_for_writes():
    with StopSignals() as signals:
        with pytest.raises(Preempted) as stopped:
            with signals.interruptible():
                os.kill(os.getpid(), signal.SIGUSR1)
                time.sleep(5)  # interrupted at once
        assert stopped.value.signum == signal.SIGUSR1
    with StopSignals() as signals:
        os.kill(os.getpid(), signal.SIGUSR2)  # e.g. while a row is written: only noted
        assert signals.received == signal.SIGUSR2
        with pytest.raises(Preempted):
            signals.check()
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL  # handlers restored


def test_ctrl_c_under_pythons_own_handler_exits_130_without_a_traceback():
    with pytest.raises(SystemExit) as exited:
        Preempted(signal.SIGINT, signal.default_int_handler).deliver()
    assert exited.value.code == 130
    seen = []  # another handler (submitit's) is handed the signal
    with pytest.raises(SystemExit):
        Preempted(signal.SIGINT, lambda signum, frame: seen.append(signum)).deliver()
    assert seen == [signal.SIGINT]
    with StopSignals() as signals:
        os.kill(os.getpid(), signal.SIGINT)  # noted, as SIGTERM is, while not interruptible
        assert signals.received == signal.SIGINT
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_crashed_and_retried_file_is_read_up_to_its_last_whole_line(tmp_path):
    """The rows up to a partial last line (cut off the file), the latest row per sample."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    rows = [{"sample_id": "a", "status": "failed", "failure_reason": "out_of_memory"},
            {"sample_id": "b", "status": "ok", "prediction": "x\u2028y"},  # a line separator inside a prediction
            {"sample_id": "a", "status": "ok", "prediction": "retried"},
            {"sample_id": "c", "status": "failed", "failure_reason": "max_prompt_tokens"}]
    text = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    (run_dir / "predictions.jsonl").write_text(text + '{"sample_id": "d", "sta', encoding="utf-8")
    store = ResultStore(run_dir, {"task": {}})
    assert store.rows == rows and store.failed_ids == {"c"} and store.done_ids == {"a", "b", "c"}
    assert (run_dir / "predictions.jsonl").read_text(encoding="utf-8") == text  # the partial line is cut off


@pytest.mark.parametrize("arguments", [
    ["policy=keydiff,tova", "budget=1k,2k", "block_size=64"],
    ["block_size=range(64,257,64)", "policy=snapkv", "budget=2k,4k"],
    ["budget=1k,2k", "policy=a,b", "budget=8k"],  # a key given twice: its first place, its last values
    ["task.limit=2", "+policy.params.window_fraction=0.1,0.2", "~logger"],
])
def test_the_sweep_grid_is_hydras_basic_sweeper_grid(arguments):
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from keydiff.run.sweep import grid_points

    params = {"experiment_name": "grid", "seed": "0,1"}
    combined = [f"{key}={value}" for key, value in params.items()] + arguments
    expected = BasicSweeper.split_arguments(OverridesParser.create().parse_overrides(combined), None)[0]
    assert grid_points(params, arguments) == expected and len(expected) > 1
