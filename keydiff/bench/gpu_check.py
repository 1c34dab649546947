"""Self-check to run first on a new machine (`make gpu-check`): what the machine is, then whether the engine is
exact there.

Prints the environment (device, GPU and driver, torch, CUDA, transformers, Triton, flash-attn, the attention
kernels the checks cover), then runs the test suite's device tests on the device in this process:
`pytest -m device --device DEVICE` on DEVICE_TESTS (tests/test_device_invariants.py: every engine invariant per
attention kernel and dtype; docs/testing.md). Each test is a row of the JSON (PASS/FAIL/SKIP, its detail, what it
recorded), written as soon as the test finishes, so a run that is cut off keeps its rows. Exit status: pytest's.

    python -m keydiff.bench.gpu_check [--device cuda] [--json check.json] [--deadline 420] [--threads 1] [-- PYTEST_ARGS]

What each test checks: docs/gpu.md#what-make-gpu-check-checks
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from importlib import metadata
from typing import Any

import torch

from keydiff.bench import common
from keydiff.cli import ArgumentParser

# Every test file with tests marked `device` (tests/test_gpu_check.py checks none is missing), so the device machine
# needs none of the other tests' imports; quick exactness checks first, Llama-3.2-3B's shape last.
DEVICE_TESTS = ("tests/test_engine.py", "tests/test_device_invariants.py")


def version(package: str) -> str | None:
    """An installed distribution's version, without importing it (importing triton fixes its interpreter mode)."""
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def flash_attn_status() -> tuple[str, str]:
    """('ok' | 'missing' | 'old', message): FA2 runs only with flash_attn >= 2.1 (bottom-right causal mask)."""
    found = version("flash-attn") or version("flash_attn")
    if found is None:
        return "missing", "flash_attn is not installed (pip install -e '.[flash]' --no-build-isolation)"
    from packaging.version import Version

    if Version(found) < Version("2.1"):
        return "old", f"flash_attn {found} < 2.1: its causal mask is top-left for queries < keys; upgrade flash-attn"
    return "ok", f"flash_attn {found}"


def environment(device: torch.device) -> dict[str, Any]:
    """What the results depend on: the device, its GPU and driver, CUDA, torch, transformers, Triton, flash-attn,
    and the attention kernels the device tests cover there."""
    cuda = device.type == "cuda"
    driver = None
    if cuda:
        try:
            driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                    capture_output=True, text=True, timeout=30).stdout.strip().splitlines()[0]
        except (OSError, IndexError, subprocess.SubprocessError):
            pass
    status, flash = flash_attn_status()
    return {"device": str(device), "gpu": torch.cuda.get_device_name(device) if cuda else None,
            "gpus": torch.cuda.device_count() if cuda else 0, "driver": driver,
            "cuda": torch.version.cuda if cuda else None, "torch": str(torch.__version__),
            "transformers": version("transformers"), "triton": version("triton") if cuda else None,
            "flash_attn": flash,
            "kernels": ["sdpa", "eager"] + (["flash_attention_2"] if cuda and status == "ok" else [])}


def detail_of(report) -> str:
    """One line: a failure's error, a skip's reason, or what a passing test recorded as `detail`."""
    if report.skipped and isinstance(report.longrepr, tuple):
        return str(report.longrepr[2]).removeprefix("Skipped: ")
    if report.failed:
        crash = getattr(report.longrepr, "reprcrash", None)
        text = crash.message if crash is not None else str(report.longrepr).strip().splitlines()[-1]
        return f"{report.when}: {text.splitlines()[0] if text else ''}"[:300]
    return str(dict(report.user_properties).get("detail", ""))


class Rows:
    """A pytest plugin: each test's row, kept and written to `path` (with `payload`) when its last phase is
    reported (a failed setup or teardown fails it, a skip in setup skips it); after `deadline` seconds, every
    test not yet started is skipped."""

    def __init__(self, path: str | None, started: dict[str, Any], payload: dict[str, Any],
                 deadline: float | None = None):
        self.path, self.started, self.payload, self.deadline = path, started, payload, deadline
        self.begin, self.rows, self.pending = time.perf_counter(), [], {}

    def add(self, row: dict[str, Any]) -> None:
        self.rows.append(row)
        if self.path:
            common.write_json(self.path, {**self.payload, "counts": counts(self.rows), "rows": self.rows}, self.started)

    def pytest_runtest_setup(self, item) -> None:  # before the runner's (a plugin named to pytest.main runs first)
        elapsed = time.perf_counter() - self.begin
        if self.deadline is not None and elapsed > self.deadline:
            import pytest

            pytest.skip(f"deadline: {elapsed:.0f} s passed ({self.deadline:.0f} s allowed), not started")

    def pytest_runtest_logreport(self, report) -> None:
        name, _, setting = report.nodeid.split("::")[-1].partition("[")
        row = self.pending.setdefault(report.nodeid, {
            "check": name, "setting": setting.removesuffix("]"), "result": "PASS", "detail": "",
            "record": None, "seconds": 0.0, "test": report.nodeid})
        row["seconds"] = round(row["seconds"] + report.duration, 3)
        if row["result"] != "FAIL" and (report.failed or report.skipped or report.when == "call"):
            row["result"] = "FAIL" if report.failed else "SKIP" if report.skipped else "PASS"
            row["detail"] = detail_of(report)
        if report.user_properties:
            row["record"] = {k: v for k, v in report.user_properties if k != "detail"} or None
        if report.when == "teardown":
            self.add(self.pending.pop(report.nodeid))

    def pytest_collectreport(self, report) -> None:
        if report.failed:
            self.add({"check": "collect", "setting": report.nodeid, "result": "FAIL",
                      "detail": str(report.longrepr).strip().splitlines()[-1][:300], "record": None,
                      "seconds": 0.0, "test": report.nodeid})


def counts(rows: list[dict]) -> dict[str, int]:
    return {k: sum(r["result"] == k for r in rows) for k in ("PASS", "FAIL", "SKIP")}


def parse_device(parser: argparse.ArgumentParser, text: str | None) -> torch.device:
    """--device as a torch device, refused in one line where it names no device this machine has."""
    try:
        device = torch.device(text or common.device_name())
    except RuntimeError:
        parser.error(f"--device {text!r} is not a device; valid: cpu, cuda, cuda:N")
    if device.type not in ("cpu", "cuda"):
        parser.error(f"--device {text}: the checks run on cpu or cuda; valid: cpu, cuda, cuda:N")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {text}: no CUDA device is visible here; valid: cpu")
    return device


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m keydiff.bench.gpu_check", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default=None, help="cpu | cuda | cuda:N (default: cuda where one is visible)")
    parser.add_argument("--json", default=None, help="also write the environment and the rows to this file, after "
                                                     "every test")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads for the checks")
    parser.add_argument("--deadline", type=float, default=None,
                        help="seconds after which no new test starts (the rest: SKIP rows); default: none")
    parser.add_argument("pytest_args", nargs="*", help="after --: more pytest arguments (-k fixed, -x)")
    args = parser.parse_args(argv)
    device = parse_device(parser, args.device)
    tests = [common.CHECKOUT / path for path in DEVICE_TESTS]
    if missing := [str(path) for path in tests if not path.exists()]:
        parser.error(f"the device tests are in a checkout's tests/ folder: {', '.join(missing)} not found")
    try:
        import pytest
    except ImportError:
        parser.error("the checks are the test suite's device tests: install pytest (pip install -e '.[dev]')")
    started = common.provenance(__spec__.name, argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    found = environment(device)
    print(common.setting_line(device.type, None, transformers=found["transformers"]), flush=True)
    print("  " + ", ".join(f"{key}: {found[key]}" for key in ("gpu", "gpus", "driver", "cuda", "triton", "flash_attn",
                                                              "kernels")), flush=True)
    rows = Rows(args.json, started, {"machine": found}, args.deadline)
    # No plugin from an entry point (hydra's, xdist's: the device machine has neither), no cache folder written.
    options = ["-m", "device", "--device", str(device), "--disable-plugin-autoload", "-p", "no:cacheprovider", "-q",
               "--no-header", "-rfEs", "--tb=short", f"--rootdir={common.CHECKOUT}", *args.pytest_args]
    print("pytest -m device --device " + " ".join([str(device), *DEVICE_TESTS, *args.pytest_args]), flush=True)
    code = int(pytest.main([*map(str, tests), *options], plugins=[rows]))
    common.print_table([("check", 0), ("setting", 0), ("result", 0), ("detail", 0)],
                       [[r["check"], r["setting"], r["result"], r["detail"]] for r in rows.rows], text_columns=4)
    print(" ".join(f"{k} {v}" for k, v in counts(rows.rows).items())
          + (" -> OK" if code == 0 else f" -> FAILED (pytest exit {code})")
          + (f"; rows in {args.json}" if args.json else ""))
    return code


if __name__ == "__main__":
    sys.exit(main())
