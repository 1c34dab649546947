"""What a user types first, run as `python run.py ...` child processes: each mistake is
one `error:` line on stderr, exit status 2, within seconds, and leaves no directory behind; a run that needs
an unreachable Hugging Face Hub says so in seconds; a SLURM dry run needs no partition."""

from __future__ import annotations

import http.server
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from keydiff.run.checks import probe_endpoint

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
QUICK_S = 3.0  # a typo is reported within this many seconds
HUB_S = 10.0  # an unreachable Hub within this many
PROXY_VARIABLES = ("http_proxy", "https_proxy", "all_proxy")  # the endpoints below are on this machine
POLICY_CHOICES = ("policy=keydif is not valid; valid: adakv_criticalkv, adakv_expected_attention, adakv_keydiff, "
                  "adakv_snapkv, adakv_snapkv_relative, chunkkv")


def child_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """The user's environment without cluster or Hub settings, with an empty Hugging Face cache."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "SBATCH_", "HYDRA_FULL_ERROR", "HF_", "HUGGINGFACE_"))
           and k.lower() not in PROXY_VARIABLES}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), HF_HOME=str(tmp_path / "hf"), **extra)
    return env


def run_py(tmp_path: Path, *args: str, **env: str) -> tuple[subprocess.CompletedProcess, float]:
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "run.py", *args, f"results_root={tmp_path / 'runs'}"], cwd=ROOT,
                            capture_output=True, text=True, timeout=120, env=child_env(tmp_path, **env))
    return result, time.perf_counter() - start


def assert_one_line_error(result: subprocess.CompletedProcess, tmp_path: Path) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2, result.stderr
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert not (tmp_path / "runs").exists()  # not even an empty run directory
    return lines[0]


@pytest.mark.parametrize("args, expected", [
    (["budget=2048"], ["budget=2048 is not valid", "budget.tokens=2048", "budget=2k", "1k, 2k, 3k, 4k, 6k, 8k"]),
    (["budget=3000"], ["budget=3000 is not valid", "budget.tokens=3000"]),
    (["budget=0"], ["budget=0 is not valid", "budget.tokens=<positive integer>"]),
    (["-m", "budget=2k,4096"], ["budget=4096 is not valid", "budget.tokens=4096", "budget=4k"]),
    (["policy=keydif"], [POLICY_CHOICES]),
    (["-m", "policy=keydif"], [POLICY_CHOICES]),
    (["task=ruler4k"], ["task=ruler4k is not valid; valid: longbench", "ruler_4k"]),
    (["polcy=keydiff"], ["polcy is not a config group or key; valid groups: budget, experiment, logger, model, "
                         "policy"]),
    (["policy=keydiff,tova"], ["policy=keydiff,tova lists several values: add -m"]),
])
def test_a_mistyped_command_line_is_one_line_exit_2_in_seconds(tmp_path, args, expected):
    result, seconds = run_py(tmp_path, *args)
    line = assert_one_line_error(result, tmp_path)
    for text in expected:
        assert text in line
    assert seconds < QUICK_S, f"{seconds:.1f} s"


@pytest.mark.parametrize("args, needed, fix, hub", [
    (["model=llama-3.2-3b-instruct"], "model.path=meta-llama/Llama-3.2-3B-Instruct", "model.path=<folder",
     {"HF_HUB_OFFLINE": "1"}),
    (["task=longbench", "task.cache_dir={tmp}/longbench"], "LongBench's data.zip", "task.data_dir=<data.zip",
     {"HF_ENDPOINT": "http://127.0.0.1:9"}),
], ids=["model-HF_HUB_OFFLINE", "longbench-endpoint-refused"])
def test_a_download_from_an_unreachable_hub_is_refused_in_seconds(tmp_path, args, needed, fix, hub):
    result, seconds = run_py(tmp_path, *(arg.format(tmp=tmp_path) for arg in args), **hub)
    line = assert_one_line_error(result, tmp_path)
    assert "Hugging Face Hub is not reachable" in line and needed in line and fix in line
    assert ("HF_HUB_OFFLINE=1" if "HF_HUB_OFFLINE" in hub else "127.0.0.1:9") in line
    assert not (tmp_path / "longbench").exists()  # nothing downloaded or created for the data either
    assert seconds < HUB_S, f"{seconds:.1f} s"


@pytest.mark.unit
def test_the_hub_probe_tells_answering_refusing_and_silent_endpoints_apart(monkeypatch):
    for name in PROXY_VARIABLES:
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.upper(), raising=False)

    class NotFound(http.server.BaseHTTPRequestHandler):
        def do_HEAD(self):  # any answer, even 404, means the Hub can be reached
            self.send_response(404)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), NotFound)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()  # quick shutdown
    silent = socket.socket()  # accepts connections (backlog) but never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    closed_port = closed.getsockname()[1]
    closed.close()  # nothing listens there any more
    try:
        assert probe_endpoint(f"http://127.0.0.1:{server.server_port}", 2.0) is None
        assert "Connection refused" in probe_endpoint(f"http://127.0.0.1:{closed_port}", 2.0)
        start = time.perf_counter()
        reason = probe_endpoint(f"http://127.0.0.1:{silent.getsockname()[1]}", 0.25)  # its whole wait
        assert reason is not None and time.perf_counter() - start < 3.0
    finally:
        server.shutdown()
        silent.close()


def test_slurm_dry_run_needs_no_partition_and_says_a_submission_will(tmp_path):
    result, _ = run_py(tmp_path, "experiment=smoke", "hydra/launcher=slurm", "hydra.launcher.partition=null",
                       "dry_run=true")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "dry run: 2 grid point(s)" in out and "#SBATCH --array=0-1%2" in out
    assert "no partition set" in out and "a real submission needs a partition" in out
    assert "#SBATCH --partition" not in out
    assert not (tmp_path / "runs").exists()
    # `make sweep-slurm` checks with a dry run before submitting in the background: that one still refuses.
    result, _ = run_py(tmp_path, "experiment=smoke", "hydra/launcher=slurm", "hydra.launcher.partition=null",
                       "dry_run=true", "hydra.sweeper.dry_run_needs_partition=true")
    assert "hydra/launcher=slurm needs a partition" in assert_one_line_error(result, tmp_path)


@pytest.mark.unit
def test_longbench_needs_the_hub_only_without_local_data(tmp_path):
    from keydiff.tasks.longbench import LongBench

    assert LongBench(data_dir=str(tmp_path)).hub_downloads() == []
    needed = LongBench(cache_dir=str(tmp_path / "cache")).hub_downloads()
    assert len(needed) == 1 and "task.data_dir=" in needed[0]
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "data.zip").write_bytes(b"")  # downloaded before: read from the cache
    assert LongBench(cache_dir=str(tmp_path / "cache")).hub_downloads() == []
