"""The separate environment that `make bench-peers` runs kvpress in: `.venv-kvpress`, built once.

    python -m keydiff.bench peers env                 # build it if it is not complete, print its python
    python -m keydiff.bench peers env --dry-run       # only show what pip would install (nothing is written)

Design: docs/design/benchmarks.md#against-kvpress-peers-peers_runner-peers_env
"""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[2]  # the checkout holding this keydiff (as keydiff.bench.common)

KVPRESS_SPEC = "kvpress==0.5.5"
TORCH_SPEC = "torch==2.13.0"
DEFAULT_ENV = CHECKOUT / ".venv-kvpress"
MARKER = ".complete"


def env_python(env: Path) -> Path:
    return env / ("Scripts/python.exe" if sys.platform == "win32" else "bin/python")


def is_complete(env: Path) -> bool:
    return (env / MARKER).is_file() and env_python(env).exists()


def check_not_main_env(env: Path) -> None:
    """Refuse to build into the project's own environment (or the interpreter running this)."""
    env = env.resolve()
    own = Path(sys.prefix).resolve()
    if env == own or env == (CHECKOUT / ".venv").resolve():
        raise SystemExit(f"refusing to install kvpress into {env}: that is the project's own environment; "
                         f"choose another --env (default {DEFAULT_ENV})")


def pip(env: Path, *arguments: str) -> None:
    command = [str(env_python(env)), "-m", "pip", *arguments]
    print("+", " ".join(command), flush=True)
    subprocess.run(command, check=True)


def installed_versions(env: Path) -> dict[str, str]:
    code = ("import importlib.metadata as m, json; print(json.dumps({p: m.version(p) for p in "
            "('kvpress', 'transformers', 'torch', 'accelerate')}))")
    out = subprocess.run([str(env_python(env)), "-c", code], check=True, capture_output=True, text=True).stdout
    return json.loads(out)


def build(env: Path = DEFAULT_ENV, torch_spec: str = TORCH_SPEC, kvpress_spec: str = KVPRESS_SPEC,
          dry_run: bool = False) -> Path:
    """The python of a complete kvpress environment at `env`, building it first when needed."""
    env = Path(env)
    check_not_main_env(env)
    if is_complete(env):
        print(f"{env}: complete ({(env / MARKER).read_text().strip()})", flush=True)
        return env_python(env)
    if dry_run:
        scratch = Path(f"{env}.dry-run")
        shutil.rmtree(scratch, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "venv", str(scratch)], check=True)
        try:
            pip(scratch, "install", "--dry-run", *shlex.split(torch_spec), kvpress_spec)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        return env_python(env)
    if env.exists():
        if not (env / "pyvenv.cfg").is_file():  # never delete a folder that is not a virtual environment
            raise SystemExit(f"{env} exists and is not a virtual environment; choose another --env")
        print(f"{env}: incomplete (no {MARKER}), rebuilding it", flush=True)
        shutil.rmtree(env)
    subprocess.run([sys.executable, "-m", "venv", str(env)], check=True)
    torch_arguments = shlex.split(torch_spec)  # a requirement, optionally with pip options (--index-url ...)
    pip(env, "install", "-q", *torch_arguments)
    pip(env, "install", "-q", kvpress_spec, torch_arguments[0])  # torch named again so the resolver keeps it
    versions = installed_versions(env)
    (env / MARKER).write_text(json.dumps(versions) + "\n", encoding="utf-8")
    print(f"{env}: complete ({json.dumps(versions)})", flush=True)
    return env_python(env)


if __name__ == "__main__":  # as `python -m keydiff.bench peers env [options]`
    from keydiff.bench import runner

    runner.command(lambda: runner.main(["peers", "env", *sys.argv[1:]]))
