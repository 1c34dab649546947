"""keydiff.run.tracking, offline (W&B in `offline` mode in a temporary directory, or a recorder for
`wandb.init`): one W&B run per run directory, per-sample history, summary names, the paper's values beside
ours, online mode without credentials."""

from __future__ import annotations

import json
import re

import pytest
from omegaconf import OmegaConf, open_dict

from keydiff.run import runner, samples, tracking
from keydiff.paper.reference import paper_values, read_tables, table_numbers
from tests.test_cluster import make_cfg as cluster_cfg, tiny  # noqa: F401  (tiny: the fixture)

pytestmark = pytest.mark.integration

wandb = pytest.importorskip("wandb")


@pytest.fixture
def isolated_wandb(tmp_path, monkeypatch):
    """No real credentials, settings or caches of this machine; wandb's process-wide state reset."""
    for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    home = tmp_path / "home"
    home.mkdir()
    for name, value in {"HOME": home, "WANDB_CONFIG_DIR": home / ".config", "WANDB_CACHE_DIR": home / ".cache",
                        "WANDB_DATA_DIR": home / ".data", "NETRC": home / ".netrc"}.items():
        monkeypatch.setenv(name, str(value))
    monkeypatch.setenv("WANDB_SILENT", "true")
    # wandb reads workspace settings from ./wandb/settings of the working directory (WANDB_DIR is applied only
    # after them): not the checkout's, where `wandb offline` leaves the user's `mode = offline` (git-ignored).
    monkeypatch.chdir(tmp_path)
    wandb.teardown()  # forget session credentials and settings of earlier tests
    yield
    wandb.teardown()


def make_cfg(tmp_path, *overrides: str):
    """tests.test_cluster's run of the tiny model, logged to W&B: three prompts, two new tokens each."""
    return cluster_cfg(tmp_path, "budget.tokens=16", "block_size=8", "logger=wandb", "experiment_name=tracked",
                       f"logger.paper_dir={tmp_path / 'paper'}", *overrides,
                       task={"lengths": [30, 40, 50], "max_new_tokens": 2})


class RecordedRun:
    def __init__(self, kwargs):
        self.kwargs, self.history, self.summary, self.finished = kwargs, [], {}, False

    def define_metric(self, *args, **kwargs):
        pass

    def log(self, data, step=None):
        self.history.append((step, {k: v for k, v in data.items() if not isinstance(v, wandb.Table)}))

    def finish(self):
        self.finished = True


@pytest.fixture
def recorded(monkeypatch):
    runs: list[RecordedRun] = []
    monkeypatch.setattr(wandb, "init", lambda **kwargs: runs.append(RecordedRun(kwargs)) or runs[-1])
    monkeypatch.setenv("WANDB_MODE", "offline")  # no credentials check; nothing reaches wandb anyway
    return runs


def run_preempted_then_resume(cfg, run_dir, monkeypatch) -> None:
    """The first invocation stops at its second sample (as a preempted job would); the second resumes."""
    real_run_sample = samples.run_sample
    calls = []

    def preempted_on_second(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("preempted")
        return real_run_sample(*args, **kwargs)

    monkeypatch.setattr(samples, "run_sample", preempted_on_second)
    with pytest.raises(RuntimeError, match="preempted"):
        runner.run(cfg, run_dir)
    monkeypatch.setattr(samples, "run_sample", real_run_sample)
    runner.run(cfg, run_dir)


@pytest.mark.extended
def test_resumed_run_continues_one_wandb_run_and_a_finished_rerun_opens_none(tmp_path, tiny, recorded, monkeypatch):
    cfg = make_cfg(tmp_path)
    run_dir = tmp_path / "runs" / "tracked" / "point"
    run_preempted_then_resume(cfg, run_dir, monkeypatch)  # rows 0, then 1 and 2
    runner.run(cfg, run_dir)  # nothing to do: W&B must not be opened

    assert len(recorded) == 2, "a no-op re-run of a finished run opened W&B"
    ids = {run.kwargs["id"] for run in recorded}
    assert ids == {tracking.run_id(cfg, run_dir)} and all(run.kwargs["resume"] == "allow" for run in recorded)
    # Steps are the rows' positions in predictions.jsonl: the resume continues at 1, nothing repeats.
    steps = [step for run in recorded for step, data in run.history if "sample/index" in data]
    assert steps == [0, 1, 2]
    assert recorded[0].finished is False and recorded[1].finished is True
    marker = json.loads((run_dir / tracking.MARKER).read_text())
    assert marker == {**marker, "id": tracking.run_id(cfg, run_dir), "logged_rows": 3, "finished": True}


@pytest.mark.extended
def test_run_id_is_stable_per_directory_and_changes_with_overwrite(tmp_path, tiny):
    cfg = make_cfg(tmp_path)
    point = tmp_path / "runs" / "tracked" / "a" / "seed0"
    first = tracking.run_id(cfg, point)
    assert first == tracking.run_id(cfg, tmp_path / "runs" / "tracked" / "a" / "x" / ".." / "seed0")
    assert first != tracking.run_id(cfg, tmp_path / "runs" / "tracked" / "b" / "seed0")
    assert re.fullmatch(r"[a-z0-9-]{1,64}", first)
    # The same relative path under another results_root (a copy on a cluster) keeps its id.
    (tmp_path / "elsewhere").mkdir()
    other = make_cfg(tmp_path / "elsewhere")
    assert tracking.run_id(other, tmp_path / "elsewhere" / "runs" / "tracked" / "a" / "seed0") == first
    # A run directory outside results_root is named by its absolute path: the same under either config.
    assert tracking.run_id(cfg, tmp_path / "adhoc" / "seed0") == tracking.run_id(other, tmp_path / "adhoc" / "seed0")
    # overwrite=true moves the old run to a sibling: the new run gets a new W&B run.
    (point.parent / "seed0.old-20260101-000000").mkdir(parents=True)
    assert tracking.run_id(cfg, point) == first + "-g1"


@pytest.mark.extended
def test_history_per_row_summary_names_and_config_keys(tmp_path, tiny, recorded):
    cfg = make_cfg(tmp_path)
    summary = runner.run(cfg, tmp_path / "runs" / "tracked" / "p")
    (run,) = recorded
    kwargs = run.kwargs
    assert kwargs["group"] == "tracked" and kwargs["job_type"] == "guard_lengths" and kwargs["name"] == cfg.run_subdir
    config = kwargs["config"]
    assert (config["model"]["name"], config["policy"]["label"], config["budget"]["tokens"], config["block_size"]) \
        == ("custom", "keydiff", 16, 8)
    rows = [data for _, data in run.history if "sample/index" in data]
    assert [row["sample/prompt_tokens"] for row in rows] == [30, 40, 50]
    assert all({"sample/ttft_s", "sample/kept_ratio", "sample/chars", "running/ttft_s"} <= set(row) for row in rows)
    assert rows[-1]["running/ttft_s"] == pytest.approx(summary["statistics"]["mean_ttft_s"])
    assert run.summary["metrics/chars"] == summary["metrics"]["chars"]
    assert run.summary["statistics/mean_kept_ratio"] == summary["statistics"]["mean_kept_ratio"]
    assert run.summary["samples"] == 3 and run.summary["complete"] is True and run.summary["limit"] == 0
    assert not any(key.startswith("paper/") for key in run.summary)  # no results/paper here: no reference


@pytest.mark.unit
def test_summary_headline_and_paper_values_beside_ours(tmp_path):
    paper = tmp_path / "paper"
    paper.mkdir()
    (paper / "table1.csv").write_text(
        "table,model,policy,budget,block_size,row,column,metric,value,note\n"
        "1,llama-3.1-8b-instruct,keydiff,2k,128,,avg,score,44.33,\n"
        "1,llama-3.1-8b-instruct,keydiff,2k,128,,qasper,score,40.1,\n"
        "1,llama-3.1-8b-instruct,keydiff,2k,128,,musique,score,,garbled\n"
        "1,llama-3.1-8b-instruct,keydiff,4k,128,,avg,score,47.66,\n"
        "1,llama-3.1-8b-instruct,snapkv,2k,128,,avg,score,39.6,\n"
        "1,llama-3.1-8b-instruct,full,,128,,avg,score,49.2,\n")
    (paper / "table4.csv").write_text(
        "table,model,policy,budget,block_size,row,column,metric,value,note\n"
        "4,deepseek-r1-distill-llama-8b,keydiff,2k,,,4K,flex,0.72,\n"
        "4,deepseek-r1-distill-llama-8b,keydiff,2k,,,8K,flex,0.819,\n")
    rows = read_tables(paper, table_numbers("table1"))
    point = dict(model="llama-3.1-8b-instruct", block_size=128, experiment_name="table1", primary="average")
    assert paper_values(rows, policy="keydiff", budget_label="2k", **point) == \
        {"score": 44.33, "metrics/datasets/qasper": 40.1}  # the garbled (empty) cell is left out
    assert paper_values(rows, policy="full", budget_label="8k", **point) == {"score": 49.2}
    assert paper_values(rows, policy="keydiff", budget_label="2k", **{**point, "block_size": 64}) == {}
    math = read_tables(paper, table_numbers("table4_gen8k"))  # Tables 4 and 6; table6.csv is absent
    assert paper_values(math, model="deepseek-r1-distill-llama-8b", policy="keydiff_w20", policy_name="keydiff",
                        budget_label="2k", block_size=128, experiment_name="table4_gen8k", primary="flex") == {"score": 0.819}
    assert read_tables(tmp_path / "missing", ("1",)) == []

    summary = {"metrics": {"average": 44.0, "datasets": {"qasper": 41.0}, "metric_environment": {"x": "y"}},
               "statistics": {"samples": 2, "mean_ttft_s": 0.5, "cache_bound_held": True},
               "complete": False, "config": {"task": {"limit": 2}}}
    scalars = tracking.summary_scalars(summary, "longbench", {"score": 44.33})
    assert scalars == {"score": 44.0, "metrics/average": 44.0, "metrics/datasets/qasper": 41.0,
                       "statistics/samples": 2, "statistics/mean_ttft_s": 0.5, "paper/score": 44.33,
                       "samples": 2, "complete": False, "limit": 2}
    assert tracking.headline("math500_8k") == ("flex", "flex") and tracking.headline("niah_small")[1] == "needle_recall"


@pytest.mark.extended
def test_two_offline_invocations_write_one_wandb_run_id(tmp_path, tiny, isolated_wandb, monkeypatch):
    cfg = make_cfg(tmp_path, "logger.mode=offline")
    with open_dict(cfg):
        cfg.task.lengths = [30, 40]
    run_dir = tmp_path / "runs" / "tracked" / "offline"
    run_preempted_then_resume(cfg, run_dir, monkeypatch)
    files = list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert files and {path.stem for path in files} == {f"run-{tracking.run_id(cfg, run_dir)}"}
    assert (run_dir / "predictions.jsonl").read_text().count("\n") == 2  # files stay the record
    assert json.loads((run_dir / tracking.MARKER).read_text())["finished"] is True


@pytest.mark.extended
def test_online_without_credentials_fails_before_any_work(tmp_path, tiny, isolated_wandb, monkeypatch):
    monkeypatch.setattr(runner, "load_model", lambda cfg: pytest.fail("loaded the model"))
    cfg = make_cfg(tmp_path, "logger.mode=online")
    run_dir = tmp_path / "runs" / "tracked" / "online"
    with pytest.raises(tracking.WandbCredentialsError, match=r"wandb login.*WANDB_API_KEY.*logger.mode=offline"):
        runner.run(cfg, run_dir)
    assert not run_dir.exists()
    with pytest.raises(ValueError, match="logger.mode 'onlne' is not valid; valid: online, offline, disabled"):
        tracking.check(make_cfg(tmp_path, "logger.mode=onlne"))
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)  # a key is found locally; nothing is verified over the network
    tracking.check(cfg)
    monkeypatch.delenv("WANDB_API_KEY")
    tracking.check(OmegaConf.create({"logger": {"wandb": False}}))  # logger=none: nothing to check

