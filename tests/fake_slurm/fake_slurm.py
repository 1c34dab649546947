"""Fake SLURM commands for tests (tests/test_cluster_processes.py puts this folder first on PATH): sbatch records the
submission and runs its array tasks one after another with a node's SLURM_* variables; sacct, srun, `scontrol requeue`
and sinfo ($FAKE_SLURM_PARTITIONS) answer as SLURM would; $FAKE_SLURM_SBATCH_ERROR makes sbatch refuse; the rest log."""

from __future__ import annotations

import json
import os
import re
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path

STATE_DIR = Path(os.environ.get("FAKE_SLURM_DIR", "/tmp/fake_slurm"))


def log_call(name: str, args: list[str]) -> None:
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    with open(STATE_DIR / "calls.log", "a") as handle:
        handle.write(json.dumps([name, *args]) + "\n")


def directives(script: str) -> dict[str, str]:
    found = {}
    for line in script.splitlines():
        match = re.match(r"#SBATCH --([\w-]+)(?:=(.*))?$", line.strip())
        if match:
            found[match.group(1)] = shlex.split(match.group(2))[0] if match.group(2) else "true"
    return found


def task_id(job_id: str, task: int | None) -> str:
    """"1000_3" for array task 3 of job 1000; "1000" for a plain job (submitit submits one job without --array)."""
    return job_id if task is None else f"{job_id}_{task}"


def fill(pattern: str, job_id: str, task: int | None) -> str:
    pattern = pattern.replace("%A", job_id).replace("%a", str(task))
    return pattern.replace("%j", task_id(job_id, task)).replace("%t", "0")


def next_job_id() -> str:
    counter = STATE_DIR / "next_id"
    value = int(counter.read_text()) if counter.exists() else 1000
    counter.write_text(str(value + 1))
    return str(value)


def sbatch(args: list[str]) -> int:
    if os.environ.get("FAKE_SLURM_SBATCH_ERROR"):  # a submission the controller refuses, as real sbatch reports it
        print(f"sbatch: error: Batch job submission failed: {os.environ['FAKE_SLURM_SBATCH_ERROR']}", file=sys.stderr)
        return 1
    script_path = Path([a for a in args if not a.startswith("-")][-1])
    script = script_path.read_text()
    job_id = next_job_id()
    params = directives(script)
    array = "array" in params
    low, high = (int(x) for x in params.get("array", "0-0").split("%")[0].split("-"))
    kept = STATE_DIR / f"job_{job_id}.sh"
    kept.write_text(script)
    with open(STATE_DIR / "submissions.jsonl", "a") as handle:
        handle.write(json.dumps({"job_id": job_id, "array": array, "array_size": high - low + 1, "script": str(kept),
                                 "cpus_per_task": params.get("cpus-per-task"), "partition": params.get("partition")}) + "\n")
    for task in range(low, high + 1) if array else [None]:
        (STATE_DIR / f"state_{task_id(job_id, task)}").write_text("PENDING")
    subprocess.Popen([sys.executable, __file__, "_run_array", job_id, str(kept), str(low), str(high), str(array)],
                     start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                     stderr=open(STATE_DIR / f"runner_{job_id}.err", "w"), cwd=os.getcwd())
    print(f"Submitted batch job {job_id}")
    return 0


def requeues(name: str) -> int:
    path = STATE_DIR / f"requeues_{name}"
    return int(path.read_text()) if path.exists() else 0


def run_task(job_id: str, script_path: str, task: int | None, count: int) -> int:
    """Run one (array) task of a submitted script as a compute node would, recording its state for sacct."""
    script = Path(script_path).read_text()
    params = directives(script)
    folder = re.search(r"-m submitit.core._submit (\S+)", script).group(1)
    pickle = Path(fill(shlex.split(folder)[0], job_id, task)) / f"{task_id(job_id, task)}_submitted.pkl"
    deadline = time.time() + 120
    while not pickle.exists() and time.time() < deadline:  # submitit moves it in after sbatch returns
        time.sleep(0.1)
    env = dict(os.environ, SLURM_JOB_ID=job_id, SLURM_NTASKS="1", SLURM_JOB_NUM_NODES="1", SLURM_NODEID="0",
               SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_JOB_NODELIST=socket.gethostname(),
               SLURM_CPUS_PER_TASK=params.get("cpus-per-task", "1"))
    if task is not None:
        env.update(SLURM_JOB_ID=str(int(job_id) + 1 + task), SLURM_ARRAY_JOB_ID=job_id,
                   SLURM_ARRAY_TASK_ID=str(task), SLURM_ARRAY_TASK_COUNT=str(count))
    name = task_id(job_id, task)
    state = STATE_DIR / f"state_{name}"
    attempt = requeues(name)
    state.write_text("RUNNING")
    out = Path(fill(params["output"], job_id, task))
    err = Path(fill(params.get("error", params["output"]), job_id, task))
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "a") as stdout, open(err, "a") as stderr:
        code = subprocess.call(["bash", script_path], env=env, stdout=stdout, stderr=stderr)
    if requeues(name) == attempt:  # else the task was requeued: it lives on in the process scontrol started
        state.write_text("COMPLETED" if code == 0 else "FAILED")
    return code


def run_array(job_id: str, script_path: str, low: int, high: int, array: bool) -> int:
    for task in range(low, high + 1) if array else [None]:
        run_task(job_id, script_path, task, high - low + 1)
    (STATE_DIR / f"done_{job_id}").write_text("done")
    return 0


def scontrol(args: list[str]) -> int:
    """`scontrol requeue <id>` (what submitit calls after a USR2): run that task again, as SLURM would."""
    if args[:1] != ["requeue"]:
        return 0
    job_id, _, task = args[1].partition("_")
    name = args[1]
    (STATE_DIR / f"requeues_{name}").write_text(str(requeues(name) + 1))
    (STATE_DIR / f"state_{name}").write_text("PENDING")
    count = len(list(STATE_DIR.glob(f"state_{job_id}_*"))) or 1
    subprocess.Popen([sys.executable, __file__, "_run_task", job_id, str(STATE_DIR / f"job_{job_id}.sh"), task,
                      str(count)], start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                     stderr=open(STATE_DIR / f"runner_{name}_requeue.err", "w"), cwd=os.getcwd())
    return 0


def srun(args: list[str]) -> int:
    outputs, i = {}, 0
    while i < len(args) and args[i].startswith("-"):
        if args[i] in ("--output", "--error", "-o", "-e"):
            outputs[args[i].lstrip("-")[0]] = args[i + 1]
            i += 2
        else:
            i += 1
    if "SLURM_ARRAY_JOB_ID" in os.environ:
        job_id, task = os.environ["SLURM_ARRAY_JOB_ID"], int(os.environ["SLURM_ARRAY_TASK_ID"])
    else:
        job_id, task = os.environ.get("SLURM_JOB_ID", "0"), None
    out_path = fill(outputs.get("o", "/dev/stdout"), job_id, task)
    err_path = fill(outputs.get("e", outputs.get("o", "/dev/stderr")), job_id, task)
    with open(out_path, "a") as stdout, open(err_path, "a") as stderr:
        child = subprocess.Popen(args[i:], stdout=stdout, stderr=stderr)
        name = task_id(job_id, task)
        (STATE_DIR / f"pid_{name}").write_text(str(child.pid))  # tests signal it like SLURM's --signal would
        return child.wait()


def sacct(args: list[str]) -> int:
    ids = [args[i + 1] for i, a in enumerate(args) if a == "-j"]
    print("JobID|State|NodeList")
    for job in ids:  # an array id stands for all its tasks
        states = [STATE_DIR / f"state_{job}"] if (STATE_DIR / f"state_{job}").exists() else []
        for state in states or sorted(STATE_DIR.glob(f"state_{job}_*")):
            print(f"{state.name[len('state_'):]}|{state.read_text()}|{socket.gethostname()}")
    return 0


def sinfo(args: list[str]) -> int:
    """The partitions (one per line, as `sinfo --noheader --format=%R`): $FAKE_SLURM_PARTITIONS, else fake and gpu."""
    print("\n".join(os.environ.get("FAKE_SLURM_PARTITIONS", "fake,gpu").split(",")))
    return 0


def main() -> int:
    command, args = sys.argv[1], sys.argv[2:]
    if command == "_run_array":
        return run_array(args[0], args[1], int(args[2]), int(args[3]), args[4] == "True")
    if command == "_run_task":
        code = run_task(args[0], args[1], int(args[2]) if args[2] else None, int(args[3]))
        (STATE_DIR / f"done_{args[0]}_{args[2]}_requeue").write_text("done")
        return code
    log_call(command, args)
    handlers = {"sbatch": sbatch, "srun": srun, "sacct": sacct, "scontrol": scontrol, "sinfo": sinfo}
    return handlers[command](args) if command in handlers else 0  # squeue, scancel: logged only


if __name__ == "__main__":
    sys.exit(main())
