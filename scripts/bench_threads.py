#!/usr/bin/env python3
"""CPU threading settings measured against each other, on a quiet machine and beside a busy process: the
measurement keydiff.openmp.DEFAULTS (what runs, benchmarks and tests start torch with) is chosen from.

    python scripts/bench_threads.py                          # every setting x every neighbour, both workloads
    python scripts/bench_threads.py --workloads model --repeats 3
    python scripts/bench_threads.py --quick                  # tiny sizes: checks the script end to end (minutes)

Settings (T: the CPUs this process may use, --threads to choose another): T threads with libgomp's own wait
(GOMP_SPINCOUNT=300000: what torch does when OMP_WAIT_POLICY is unset), T threads with OMP_WAIT_POLICY=PASSIVE
(idle workers sleep at once), T threads with a short spin (GOMP_SPINCOUNT=10000, about 0.1 ms), and 1 thread.
Neighbours: none (quiet), `busy` (a plain CPU-bound Python loop: one core taken) and `same` (a second process
running the same workload under the same setting, over and over: two copies of the harness on one machine).

Workloads, each measured in a fresh process started with exactly the setting's variables (every variable of
keydiff.openmp.VARIABLES removed from the inherited environment first; the child records what it ran with):
  * model: the default model (smollm2-135m, offline) prefills an L-token random prompt under KeyDiff at N, in
    blocks of B (TTFT, after an untimed warm-up), then its fork into `batch` caches decodes --new-tokens tokens
    together (keydiff.generate_batch: aggregate decode tokens/s). Under a minute per cell on a quiet 2-core CPU
    (an estimate from docs/performance.md's TTFT and tokens/s; several times that beside a neighbour).
  * tests: `python -m pytest -q <--tests>` (default: the 23 tests of test_batching.py's
    test_fork_equals_separate_runs, about 10 s quiet at 1 thread): the wall time a developer waits, interpreter
    start and imports included.
Cells run setting by setting within each neighbour (so drift spreads over the settings); a cell over --timeout
is recorded as timed out. The table gives the median over --repeats; the JSON (--json, by default a new
timestamped file under results/bench/) every cell, each child's own thread settings, and the provenance; a
run that fails or is interrupted still writes the cells it took ("complete": false).
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from keydiff import openmp
from keydiff.bench import common

NEIGHBOURS = ("none", "busy", "same")
WORKLOADS = ("model", "tests")
BUSY_LOOP = "while True: pass"


def settings(cores: int) -> dict[str, dict[str, str]]:
    """The settings compared, by name: the variables each child starts with (nothing else of VARIABLES)."""
    many = str(cores)
    return {f"{cores} threads, libgomp default": {"OMP_NUM_THREADS": many, "GOMP_SPINCOUNT": "300000"},
            f"{cores} threads, PASSIVE": {"OMP_NUM_THREADS": many, "OMP_WAIT_POLICY": "PASSIVE"},
            f"{cores} threads, spin 10k": {"OMP_NUM_THREADS": many, "GOMP_SPINCOUNT": "10000"},
            "1 thread": {"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}}


def child_environment(variables: dict[str, str]) -> dict[str, str]:
    """This environment without any of keydiff.openmp.VARIABLES (this process's own defaults included), plus
    `variables`, with this checkout first on PYTHONPATH."""
    env = {k: v for k, v in os.environ.items() if k not in openmp.VARIABLES}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(common.CHECKOUT), os.environ.get("PYTHONPATH")]))
    return {**env, **variables}


# ----------------------------------------------------------------------------------------- the workloads


def model_workload(args) -> dict[str, Any]:
    """Load, warm up, then one timed prefill and one timed batched decode; with --loop, the last two forever
    (a neighbour), after printing `ready`."""
    import torch

    from keydiff.bench.throughput import batched_decode, prefilled

    model = common.build_model(args.model, torch.float32, "sdpa", "cpu")
    prompt = common.random_prompt(model, args.length)
    warm = prefilled(model, prompt[:, : 2 * args.block_size], "keydiff", args.budget, args.block_size)
    batched_decode(model, warm.fork(2), 3, "cpu")  # the first calls' one-time costs, untimed
    if args.loop:
        print("ready", flush=True)
    while True:
        start = time.perf_counter()
        state = prefilled(model, prompt, "keydiff", args.budget, args.block_size)
        ttft = time.perf_counter() - start
        decode = batched_decode(model, state.fork(args.batch), args.new_tokens, "cpu")["seconds"]
        if not args.loop:
            return {"ttft_s": ttft, "decode_s": decode,
                    "decode_tokens_per_s": args.batch * (args.new_tokens - 1) / decode,
                    "threads": torch.get_num_threads(), "openmp": openmp.settings()}


def tests_workload(args) -> dict[str, Any]:
    """The wall time of `python -m pytest -q` on --tests in a fresh interpreter; with --loop, forever."""
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args.tests.split(",")]
    if args.loop:
        print("ready", flush=True)
    while True:
        start = time.perf_counter()
        result = subprocess.run(command, cwd=common.CHECKOUT, capture_output=True, text=True)
        seconds = time.perf_counter() - start
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed:\n{result.stdout[-2000:]}{result.stderr[-2000:]}")
        if not args.loop:
            return {"wall_s": seconds, "environment": {k: os.environ[k] for k in openmp.VARIABLES if k in os.environ}}


def worker(args) -> None:
    """One workload in this process (started by `cell` with the setting's environment): its result as one JSON line."""
    result = model_workload(args) if args.worker == "model" else tests_workload(args)
    print(json.dumps(result), flush=True)


# ----------------------------------------------------------------------------------------- the cells


def worker_command(args, workload: str, loop: bool) -> list[str]:
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", workload, "--model", args.model,
               "--length", str(args.length), "--budget", str(args.budget), "--block-size", str(args.block_size),
               "--batch", str(args.batch), "--new-tokens", str(args.new_tokens), "--tests", args.tests]
    return command + (["--loop"] if loop else [])


def start_neighbour(kind: str, command: list[str], env: dict[str, str], timeout: float) -> subprocess.Popen | None:
    """The neighbour of a cell, running once this returns (`same`: after its model load and warm-up)."""
    if kind == "none":
        return None
    if kind == "busy":
        return subprocess.Popen([sys.executable, "-c", BUSY_LOOP], env=env, start_new_session=True)
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                               start_new_session=True)  # its own process group: stopped with its pytest children
    ready, _, _ = select.select([process.stdout], [], [], timeout)
    if not ready or process.stdout.readline().strip() != "ready":
        stop(process)
        raise RuntimeError(f"the `same` neighbour did not start within {timeout:.0f} s: {' '.join(command)}")
    return process


def stop(process: subprocess.Popen | None) -> None:
    """End a neighbour and its children (its process group, which only it and its children are in)."""
    if process is None or process.poll() is not None:
        return
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def cell(args, workload: str, neighbour: str, variables: dict[str, str]) -> dict[str, Any]:
    """One measurement: the neighbour started, the workload run once in a fresh process, the neighbour stopped."""
    env = child_environment(variables)
    process = start_neighbour(neighbour, worker_command(args, workload, loop=True), env, args.timeout)
    try:
        result = subprocess.run(worker_command(args, workload, loop=False), env=env, capture_output=True, text=True,
                                timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"timed_out": True}
    finally:
        stop(process)
    if result.returncode != 0:
        raise RuntimeError(f"the {workload} workload failed (exit {result.returncode}):\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------------------- the report

MEASURES = {"model": [("ttft_s", "TTFT s", ".2f"), ("decode_tokens_per_s", "tok/s", ".1f")],
            "tests": [("wall_s", "wall s", ".1f")]}


def medians(cells: list[dict[str, Any]], workload: str) -> list[dict[str, Any]]:
    """Per (setting, neighbour): the median of each measure over the repeats (None when any repeat timed out)."""
    rows = []
    for key in dict.fromkeys((c["setting"], c["neighbour"]) for c in cells if c["workload"] == workload):
        runs = [c["result"] for c in cells if (c["setting"], c["neighbour"]) == key and c["workload"] == workload]
        row = {"workload": workload, "setting": key[0], "neighbour": key[1], "repeats": len(runs)}
        for measure, _, _ in MEASURES[workload]:
            values = [run.get(measure) for run in runs]
            row[measure] = None if None in values else statistics.median(values)
        rows.append(row)
    return rows


def print_tables(rows: list[dict[str, Any]], workloads: list[str], neighbours: list[str]) -> None:
    for workload in workloads:
        columns = [("setting", 28)] + [(f"{label} {n}", 10) for n in neighbours for _, label, _ in MEASURES[workload]]
        lines = []
        for setting in dict.fromkeys(r["setting"] for r in rows if r["workload"] == workload):
            line = [setting]
            for neighbour in neighbours:
                row = next(r for r in rows if (r["workload"], r["setting"], r["neighbour"]) == (workload, setting,
                                                                                             neighbour))
                line += [common.fmt(row[measure], spec) for measure, _, spec in MEASURES[workload]]
            lines.append(line)
        print(f"\n{workload} (neighbour: none = quiet, busy = a CPU-bound loop, same = this workload beside itself; "
              "- = timed out)")
        common.print_table(columns, lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default="model,tests", help=f"comma list of {', '.join(WORKLOADS)}")
    parser.add_argument("--neighbours", default=",".join(NEIGHBOURS), help=f"comma list of {', '.join(NEIGHBOURS)}")
    parser.add_argument("--threads", type=int, default=max(2, len(os.sched_getaffinity(0))),
                        help="the thread count of the multi-thread settings (default: the CPUs this process may use)")
    parser.add_argument("--repeats", type=int, default=1, help="cells per (setting, neighbour); the median is reported")
    parser.add_argument("--timeout", type=float, default=600, help="seconds before a cell is recorded as timed out")
    parser.add_argument("--model", default="smollm2-135m", help="model workload: smollm2-135m | random-tiny | ...")
    parser.add_argument("--length", type=int, default=3072, help="model workload: prompt tokens L")
    parser.add_argument("--budget", type=int, default=1024, help="model workload: KeyDiff's N")
    parser.add_argument("--block-size", type=int, default=128, help="model workload: prompt tokens per forward, B")
    parser.add_argument("--batch", type=int, default=8, help="model workload: sequences decoding together")
    parser.add_argument("--new-tokens", type=int, default=16, help="model workload: tokens per sequence (>= 2)")
    parser.add_argument("--tests", default="tests/test_batching.py::test_fork_equals_separate_runs",
                        help="tests workload: pytest paths or node ids, comma list (default: 23 batching tests)")
    parser.add_argument("--quick", action="store_true",
                        help="tiny sizes (random-tiny, L=512, batch 2, 4 tokens, one small test file): checks the "
                             "script end to end; its numbers mean nothing (no JSON unless --json)")
    parser.add_argument("--json", default=None, help="default: a new results/bench/threads_cpu_<time>.json")
    parser.add_argument("--worker", choices=WORKLOADS, help=argparse.SUPPRESS)  # a cell's child process
    parser.add_argument("--loop", action="store_true", help=argparse.SUPPRESS)  # a `same` neighbour
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args)
    workloads, neighbours = args.workloads.split(","), args.neighbours.split(",")
    for given, valid, option in ((workloads, WORKLOADS, "--workloads"), (neighbours, NEIGHBOURS, "--neighbours")):
        if not given or not set(given) <= set(valid):
            parser.error(f"{option} {','.join(given)}: valid: {', '.join(valid)}")
    if args.repeats < 1 or args.threads < 2 or args.new_tokens < 2:
        parser.error("--repeats must be >= 1, --threads >= 2 (1 thread is always measured), --new-tokens >= 2")
    if args.quick:
        args.model, args.length, args.budget, args.block_size, args.batch, args.new_tokens = (
            "random-tiny", 512, 128, 64, 2, 4)
        args.tests = "tests/test_placement.py"
    missing = [t for t in args.tests.split(",") if not (common.CHECKOUT / t.split("::")[0]).exists()]
    if "tests" in workloads and missing:
        parser.error(f"--tests {','.join(missing)}: no such file under {common.CHECKOUT}")
    started = common.provenance("scripts.bench_threads", argv)
    compared = settings(args.threads)
    plan = [(w, n, s) for _ in range(args.repeats) for w in workloads for n in neighbours for s in compared]
    print(f"model workload: {args.model}, L={args.length}, KeyDiff N={args.budget}, B={args.block_size}, batch "
          f"{args.batch} x {args.new_tokens} tokens; tests workload: pytest {args.tests}", flush=True)
    progress = common.Progress(f"{len(plan)} cell(s), each a fresh process (the model workload: under a minute on a "
                               "quiet 2-core CPU, several times that beside a neighbour)", len(set(plan)))
    path = args.json or (None if args.quick else
                         common.CHECKOUT / "results" / "bench" / f"threads_cpu_{time.strftime('%Y%m%d-%H%M%S')}.json")
    cells: list[dict[str, Any]] = []
    try:
        for index, (workload, neighbour, setting) in enumerate(plan):
            progress.start(f"{workload}, {setting}, neighbour {neighbour}", plan[index:])
            result = cell(args, workload, neighbour, compared[setting])
            seconds = progress.done((workload, neighbour, setting))
            cells.append({"workload": workload, "neighbour": neighbour, "setting": setting,
                          "variables": compared[setting], "result": result, "cell_s": seconds})
    finally:  # a failed or interrupted measurement still keeps the cells it took
        rows = [row for workload in workloads for row in medians(cells, workload)]
        if path is not None and cells:
            sizes = {k: getattr(args, k) for k in ("model", "length", "budget", "block_size", "batch", "new_tokens")}
            common.write_json(path, {"complete": len(cells) == len(plan), "settings": compared,
                                     "neighbours": {"busy": BUSY_LOOP, "same": "the workload, looped"},
                                     "workloads": {"model": sizes, "tests": args.tests.split(",")},
                                     "medians": rows, "cells": cells}, started)
            print(f"wrote {path} ({len(cells)} of {len(plan)} cells)", file=sys.stderr)
    print_tables(rows, workloads, neighbours)


if __name__ == "__main__":
    main()
