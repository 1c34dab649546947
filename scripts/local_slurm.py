#!/usr/bin/env python3
"""A one-node SLURM cluster on this machine, for CI and the real-scheduler tests (tests/test_slurm_real.py).

    python scripts/local_slurm.py start    # idempotent: exits 0 once `sinfo` shows the node idle
    python scripts/local_slurm.py status
    python scripts/local_slurm.py stop

It needs root and Debian's packages (`apt-get install -y slurm-wlm munge`, SLURM 22.05). `start` writes a
minimal configuration (one node, this host, with its CPUs and memory; one `debug` partition; no accounting; requests the node cannot meet are refused by sbatch, as on most clusters;
ProctrackType=proctrack/linuxproc and TaskPlugin=task/none, so no cgroups are needed) to
/etc/slurm/slurm.conf, but only where that file is absent or was written here (its first line says so): a
real cluster's configuration is never touched. It starts munged, slurmctld and slurmd if they are not
running, and waits until the node is idle. When that cannot be done it prints one line saying why, then
exits 1. State, spool and logs live under /var/lib/keydiff-slurm. A requeued job may start again after
AuthInfo's cred_expire (30 s here; SLURM's default is 120 s), which keeps the requeue tests short.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

CONF = Path("/etc/slurm/slurm.conf")
STATE = Path("/var/lib/keydiff-slurm")
# The first line of every configuration written here (its old module name kept: earlier ones are still ours).
MARK = "# written by keydiff.run.local_slurm (one-node test cluster); delete to manage it yourself"
PARTITION = "debug"
NEEDED = ("munged", "slurmctld", "slurmd", "sinfo", "sbatch", "srun", "scontrol")


class ClusterUnavailable(RuntimeError):
    """Why no local cluster can be started here (one line)."""


def memory_mb() -> int:
    with open("/proc/meminfo") as handle:
        total_kb = next(int(line.split()[1]) for line in handle if line.startswith("MemTotal:"))
    return max(1, total_kb // 1024 - 512)  # leave the OS some room, as slurmd would report less anyway


def config_text(host: str) -> str:
    cpus = os.cpu_count() or 1
    return f"""{MARK}
ClusterName=keydiff-local
SlurmctldHost={host}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=cred_expire=30
StateSaveLocation={STATE}/ctld
SlurmdSpoolDir={STATE}/d
SlurmctldPidFile={STATE}/slurmctld.pid
SlurmdPidFile={STATE}/slurmd.pid
SlurmctldLogFile={STATE}/slurmctld.log
SlurmdLogFile={STATE}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
ReturnToService=2
EnforcePartLimits=ALL
MinJobAge=300
KillWait=10
SlurmctldTimeout=30
SlurmdTimeout=60
NodeName={host} CPUs={cpus} RealMemory={memory_mb()} State=UNKNOWN
PartitionName={PARTITION} Nodes={host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
"""


def running(name: str) -> bool:
    """A process of that exact name exists (read from /proc: no procps needed)."""
    for comm in Path("/proc").glob("[0-9]*/comm"):
        try:
            if comm.read_text().strip() == name:
                return True
        except OSError:  # the process ended meanwhile
            continue
    return False


def node_state() -> str:
    """The node's state as sinfo reports it ("idle", "mix", "down*", ...), "" when the controller does not answer."""
    try:
        answer = subprocess.run(["sinfo", "--noheader", "--partition", PARTITION, "--format=%T"],
                                capture_output=True, text=True, timeout=20)
    except subprocess.TimeoutExpired:
        return ""
    return answer.stdout.strip().splitlines()[0] if answer.returncode == 0 and answer.stdout.strip() else ""


def check_prerequisites() -> None:
    missing = [name for name in NEEDED if shutil.which(name) is None]
    if missing:
        raise ClusterUnavailable(f"{', '.join(missing)} not installed (apt-get install -y slurm-wlm munge)")
    if os.geteuid() != 0:
        raise ClusterUnavailable("starting slurmctld/slurmd/munged needs root")
    if CONF.exists() and CONF.read_text().splitlines()[:1] != [MARK]:
        raise ClusterUnavailable(f"{CONF} exists and was not written here: this machine has its own SLURM setup")


def start_daemon(command: list[str], name: str) -> None:
    if running(name):
        return
    result = subprocess.run(command, capture_output=True, text=True, timeout=60)
    if result.returncode != 0:
        reason = (result.stderr.strip() or result.stdout.strip() or "no message").splitlines()[-1]
        raise ClusterUnavailable(f"{name} did not start: {reason}")


def start(wait_s: float = 60) -> str:
    """Start what is not running; return the node state once it is usable (idle/mixed/allocated)."""
    check_prerequisites()
    host = socket.gethostname()
    for sub in ("ctld", "d"):
        (STATE / sub).mkdir(parents=True, exist_ok=True)
    text = config_text(host)
    changed = not CONF.exists() or CONF.read_text() != text
    if changed:
        CONF.parent.mkdir(parents=True, exist_ok=True)
        CONF.write_text(text)
    if not Path("/etc/munge/munge.key").exists():
        subprocess.run(["mungekey", "--create"], check=False, capture_output=True)
    Path("/run/munge").mkdir(parents=True, exist_ok=True)
    shutil.chown("/run/munge", "munge", "munge")
    start_daemon(["runuser", "-u", "munge", "--", "munged"], "munged")
    if changed:  # restart what runs, so that every setting (AuthInfo too) is read anew
        stop()
    start_daemon(["slurmctld"], "slurmctld")
    start_daemon(["slurmd"], "slurmd")
    deadline = time.time() + wait_s
    state = ""
    while time.time() < deadline:
        state = node_state()
        if state.startswith(("idle", "mix", "alloc")):
            return state
        if state.startswith(("down", "drain")):
            subprocess.run(["scontrol", "update", f"nodename={host}", "state=resume"], capture_output=True)
        time.sleep(1)
    raise ClusterUnavailable(f"the node is not idle after {wait_s:.0f} s (sinfo: {state or 'no answer'}; "
                             f"logs in {STATE})")


def stop() -> None:
    """SIGTERM to the slurmd and slurmctld this configuration started (by their pid files); munged stays."""
    for name in ("slurmd", "slurmctld"):
        pid_file = STATE / f"{name}.pid"
        if pid_file.exists():
            try:
                os.kill(int(pid_file.read_text().strip()), 15)
            except (ProcessLookupError, ValueError):
                continue
            deadline = time.time() + 20
            while running(name) and time.time() < deadline:
                time.sleep(0.2)


def main(argv: list[str] | None = None) -> int:
    command = ((argv if argv is not None else sys.argv[1:]) or ["start"])[0]
    if command in ("-h", "--help"):
        print(__doc__)
        return 0
    if command not in ("start", "status", "stop"):
        print(f"error: unknown command {command!r}; valid: start, status, stop", file=sys.stderr)
        return 2
    try:
        if command == "start":
            state = start()
            print(f"local SLURM cluster up: partition {PARTITION}, node {socket.gethostname()} {state}")
        elif command == "status":
            state = node_state()
            print(f"local SLURM cluster: {state or 'not answering'}")
            return 0 if state else 1
        else:
            stop()
            print("slurmctld and slurmd stopped")
    except ClusterUnavailable as error:
        print(f"no local SLURM cluster: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
