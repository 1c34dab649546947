"""keydiff.run.tracking, offline (a recorder for `wandb.init`, or W&B in a temporary directory): a resumed run
continues one W&B run, the paper's values beside ours, online mode without credentials refused."""

from __future__ import annotations

import json

import pytest
from omegaconf import OmegaConf

from keydiff.run import runner, tracking
from keydiff.paper.reference import paper_values, read_tables, table_numbers
from tests.test_cluster import inject, make_cfg as cluster_cfg, tiny  # noqa: F401  (tiny: the fixture)

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


@pytest.mark.extended
def test_resumed_run_continues_one_wandb_run_and_a_finished_rerun_opens_none(tmp_path, tiny, recorded, monkeypatch):
    cfg = make_cfg(tmp_path)
    run_dir = tmp_path / "runs" / "tracked" / "point"
    inject(monkeypatch, {"len40": RuntimeError("preempted")})  # the first invocation stops at its second sample
    with pytest.raises(RuntimeError, match="preempted"):
        runner.run(cfg, run_dir)
    runner.run(cfg, run_dir)  # resumed: rows 1 and 2
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


@pytest.mark.unit
def test_the_papers_values_of_a_grid_point_are_logged_beside_ours(tmp_path):
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

