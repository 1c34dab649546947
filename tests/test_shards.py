"""shard=i/n: deterministic sample subsets, merged into their grid point only when every shard is complete."""

from __future__ import annotations

import json
import signal
from dataclasses import dataclass
from pathlib import Path

import pytest

from keydiff.config import shard_suffix
from keydiff.report.collect import collect
from keydiff.run import runner, samples
from keydiff.run.checks import ConfigError, check_run_config
from keydiff.run.results import run_dir_of
from keydiff.run.shard_merge import REFUSED, UP_TO_DATE, WAITING, merge_all, stale_points
from keydiff.run.shards import Shard, expand_all, parse_shard
from keydiff.run.sweep import point_status, sample_ids
from keydiff.tasks.base import GenerationSettings, Prompt, Sample
from tests.conftest import LengthsTask
from tests.test_cluster import make_cfg, tiny  # noqa: F401  (tiny: the fixture)

pytestmark = pytest.mark.unit

LENGTHS = [30, 100, 45, 70, 20]  # 5 samples, unsorted lengths


@dataclass
class SampledLengthsTask(LengthsTask):
    """Sampled decoding: a sample's seed comes from the run seed and its id, whichever shard runs it."""

    def build_prompt(self, sample: Sample, tokenizer, max_length) -> Prompt:
        prompt = super().build_prompt(sample, tokenizer, max_length)
        prompt.generation = GenerationSettings(max_new_tokens=self.max_new_tokens, min_new_tokens=1, do_sample=True,
                                               temperature=1.5)
        return prompt


def cfg_for(tmp_path, *overrides: str, limit: int | None = None):
    return make_cfg(tmp_path, "experiment_name=sharded", *overrides,
                    task={"_target_": "tests.test_shards.SampledLengthsTask", "lengths": LENGTHS, "max_new_tokens": 6,
                          "limit": limit})


def run_shard(tmp_path, spec: str | None, *overrides: str, limit: int | None = None) -> dict:
    cfg = cfg_for(tmp_path, *((f"shard={spec}",) if spec else ()), *overrides, limit=limit)
    return runner.run(cfg, run_dir_of(cfg))


def test_shard_spec_is_checked_in_one_line_naming_the_valid_form(tmp_path):
    assert parse_shard(None) is None and parse_shard("2/8") == Shard(2, 8) and parse_shard("1/1") == Shard(1, 1)
    for bad in ("0/8", "2of8", "02/8", 2, "all/8", " 2/8", "2/0"):
        with pytest.raises(ValueError) as error:
            parse_shard(bad)
        message = str(error.value)
        assert "\n" not in message and f"shard={bad!r}" in message and "valid: shard=i/n with 1 <= i <= n" in message
    with pytest.raises(ValueError, match=r"add -m for a sweep, or run one of them: shard=1/8"):
        parse_shard("all/8")
    assert expand_all("all/3") == ["1/3", "2/3", "3/3"] and expand_all("2/3") is None
    # conf/config.yaml's run_subdir names the directory keydiff.run.shards looks for
    assert shard_suffix("2/8") == f"/shards/{Shard(2, 8).dirname}" and shard_suffix(None) == ""
    with pytest.raises(ConfigError, match=r"^shard='3/2' is not valid: shard 3 of 2 does not exist; valid: shard=i/n"):
        check_run_config(cfg_for(tmp_path, "shard=3/2"))
    check_run_config(cfg_for(tmp_path, "shard=2/2"))


@pytest.mark.integration
@pytest.mark.extended
def test_a_missing_shard_means_no_result_status_names_it_and_tables_never_see_it(tmp_path, tiny):
    for spec in ("1/3", "3/3"):
        run_shard(tmp_path, spec)
    point = run_dir_of(cfg_for(tmp_path))
    outcomes = merge_all(tmp_path / "runs")
    assert [o.state for o in outcomes] == [WAITING] and "missing: 2/3 not started" in outcomes[0].message
    assert not (point / "summary.json").exists() and not (point / "predictions.jsonl").exists()
    assert len(collect(tmp_path / "runs", tmp_path / "summary.csv")) == 0  # no partly merged row in any table

    status = point_status(point, sample_ids(cfg_for(tmp_path)))
    assert status.state == "partial" and status.sharded
    assert status.describe() == "partial (3 of 5); 2 of 3 shards complete; missing: 2/3 not started"
    shard_status = point_status(point / "shards" / "1of3", sample_ids(cfg_for(tmp_path, "shard=1/3")))
    assert shard_status.describe() == "complete (2 of 2)"  # a shard is a grid point of its own in a shard=all/3 sweep

    run_shard(tmp_path, "2/3")
    status = point_status(point, sample_ids(cfg_for(tmp_path)))
    assert status.state == "complete" and status.shards.endswith("not merged yet (make collect)")
    frame = collect(tmp_path / "runs", tmp_path / "summary.csv")
    assert len(frame) == 1 and bool(frame["complete"].iloc[0]) and frame["samples"].iloc[0] == 5
    assert point_status(point, sample_ids(cfg_for(tmp_path))).describe() == "complete (5 of 5); 3 of 3 shards complete, merged"


@pytest.mark.integration
@pytest.mark.extended
def test_a_shard_rerun_after_the_merge_leaves_the_old_result_out_until_every_shard_is_complete(tmp_path, tiny, monkeypatch):
    for spec in ("1/2", "2/2"):
        run_shard(tmp_path, spec)
    assert len(collect(tmp_path / "runs", tmp_path / "summary.csv")) == 1
    assert [o.state for o in merge_all(tmp_path / "runs")] == [UP_TO_DATE]  # a second collect changes nothing
    point = run_dir_of(cfg_for(tmp_path))
    merged_bytes = (point / "predictions.jsonl").read_bytes()

    # shard 2 started again from scratch (overwrite=true moves its rows aside) and stopped after one sample
    real = samples.run_sample
    calls = []

    def stop_after_one(*args, **kwargs):
        if calls:
            raise runner.Preempted(signal.SIGTERM, signal.SIG_DFL)
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(samples, "run_sample", stop_after_one)
    with pytest.raises(runner.Preempted):
        run_shard(tmp_path, "2/2", "overwrite=true")
    assert stale_points(tmp_path / "runs") == {point}
    assert len(collect(tmp_path / "runs", tmp_path / "summary.csv")) == 0  # the old merge is out of the tables
    assert (point / "predictions.jsonl").read_bytes() == merged_bytes  # and kept on disk
    status = point_status(point, sample_ids(cfg_for(tmp_path)))
    assert status.state == "partial" and status.describe().endswith(
        "1 of 2 shards complete; missing: 2/2 partial (1 of 2); the earlier merged result is out of the tables until then")

    monkeypatch.setattr(samples, "run_sample", real)
    run_shard(tmp_path, "2/2")
    frame = collect(tmp_path / "runs", tmp_path / "summary.csv")
    assert len(frame) == 1 and frame["samples"].iloc[0] == 5 and stale_points(tmp_path / "runs") == set()


@pytest.mark.integration
@pytest.mark.extended
def test_a_point_holding_a_run_of_its_own_is_never_overwritten_by_a_merge(tmp_path, tiny):
    own = run_shard(tmp_path, None, limit=2)  # an unsharded subset run ...
    point = Path(own["run_dir"])
    before = (point / "predictions.jsonl").read_bytes()
    for spec in ("1/2", "2/2"):  # ... and the same point's shards
        assert Path(run_shard(tmp_path, spec, limit=2)["run_dir"]).parent.parent == point
    outcomes = merge_all(tmp_path / "runs")
    assert [o.state for o in outcomes] == [REFUSED] and "holds a run of its own" in outcomes[0].message
    assert (point / "predictions.jsonl").read_bytes() == before
    frame = collect(tmp_path / "runs", tmp_path / "summary.csv")
    assert len(frame) == 1 and frame["samples"].iloc[0] == own["num_samples"] == 2


@pytest.mark.integration
@pytest.mark.extended
def test_shards_that_disagree_are_not_merged(tmp_path, tiny):
    run_shard(tmp_path, "1/2", limit=2)
    run_shard(tmp_path, "2/2", "decode_eviction=false", limit=2)  # same directory layout, another configuration
    outcomes = merge_all(tmp_path / "runs")
    assert [o.state for o in outcomes] == [REFUSED] and "different configurations" in outcomes[0].message
    assert len(collect(tmp_path / "runs", tmp_path / "summary.csv")) == 0


@pytest.mark.integration
@pytest.mark.extended
def test_a_shard_with_no_samples_is_complete_at_once(tmp_path, tiny):
    summary = run_shard(tmp_path, "7/7", limit=3)
    assert summary["complete"] and summary["num_samples"] == 0 and tiny == []
    assert point_status(Path(summary["run_dir"]), sample_ids(cfg_for(tmp_path, "shard=7/7", limit=3))).state == "complete"


def fake_shard(point: Path, spec: str, ids: list[str], positions: list[int], total: int, rows: list[str]) -> None:
    """A shard directory as a run leaves it: its manifest and its rows (no model needed)."""
    shard = parse_shard(spec)
    folder = point / "shards" / shard.dirname
    folder.mkdir(parents=True)
    folder.joinpath("shard.json").write_text(json.dumps({
        "shard": spec, "index": shard.index, "count": shard.count, "total_samples": total, "samples_sha256": "x",
        "sample_ids": ids, "positions": positions}))
    folder.joinpath("predictions.jsonl").write_text("".join(json.dumps({"sample_id": i, "status": "ok"}) + "\n" for i in rows))


def test_status_describes_failed_partial_and_sharded_points(tmp_path):
    from keydiff.run.status import experiment_status

    root = tmp_path / "runs"
    point = root / "smoke/niah_small/smollm2-135m/keydiff/1k/bs128/seed0-limit2"  # samples L1500/d0, L1500/d50
    point.mkdir(parents=True)
    ok = {"sample_id": "L1500/d0", "status": "ok"}
    oom = {"sample_id": "L1500/d50", "status": "failed", "failure_reason": "out_of_memory"}
    (point / "predictions.jsonl").write_text(json.dumps(ok) + "\n" + json.dumps(oom) + "\n")
    described = {p[0]: s.describe() for p, _, s in experiment_status("smoke", [f"results_root={root}",
                                                                               "policy=keydiff,tova,sink"])}
    assert described == {"policy=keydiff": "failed samples (1 of 2)", "policy=tova": "not started",
                         "policy=sink": "not started"}
    (point / "predictions.jsonl").write_text(json.dumps(ok) + "\n")
    found = experiment_status("smoke", [f"results_root={root}"])
    assert [s.describe() for _, _, s in found] == ["partial (1 of 2)", "not started"]
    assert all(s.needs_run() for _, _, s in found)

    (point / "predictions.jsonl").unlink()
    fake_shard(point, "1/2", ["L1500/d0"], [0], 2, ["L1500/d0"])
    described = {p[0]: s.describe() for p, _, s in experiment_status("smoke", [f"results_root={root}"])}
    assert described == {"policy=keydiff": "partial (1 of 2); 1 of 2 shards complete; missing: 2/2 not started",
                         "policy=tova": "not started"}
    per_shard = {" ".join(p[:1] + p[-1:]): s.describe()
                 for p, _, s in experiment_status("smoke", [f"results_root={root}", "shard=all/2"])}
    assert per_shard == {"policy=keydiff shard=1/2": "complete (1 of 1)", "policy=keydiff shard=2/2": "not started",
                         "policy=tova shard=1/2": "not started", "policy=tova shard=2/2": "not started"}
