"""The one benchmark runner: `python -m keydiff.bench CASE [options]` (`make bench CASE=...`).

Each benchmark module holds one `Case` (its shared and own options, a check, its run); the runner parses, sets
threads, device and dtype, runs it and writes --json with provenance. `measure_in_child` runs a case's `child`
in a fresh process, for memory peaks. Design: docs/design/benchmarks.md#one-runner-runner
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from dataclasses import dataclass, field
from typing import Any, Callable

from keydiff.bench import common
from keydiff.cli import ArgumentParser, exit_with_error

CASES = ("prefill", "decode", "throughput", "batch_steps", "fixed_step", "adaptive", "long_prefill", "scoring",
         "peers", "gpu_bench")  # each the name of the keydiff.bench module holding its CASE
CHILD = "--child"  # measure_in_child's first argument: the rest is the case and its arguments as JSON


def option(*flags: str, **settings: Any) -> tuple[tuple[str, ...], dict[str, Any]]:
    """One argparse option: its flags and add_argument's keywords."""
    return flags, settings


SHARED = {
    "model": option("--model", default=None,
                    help="smollm2-135m | random-tiny | random-smollm2 | random-llama-3.2-3b | hub id/path "
                         "(default %(default)s)"),
    "dtype": option("--dtype", default=None, choices=list(common.DTYPES),
                    help="default: bfloat16 on CUDA, float32 on CPU"),
    "attn": option("--attn", default="sdpa", choices=["sdpa", "eager", "flash_attention_2"]),
    "threads": option("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)"),
    "device": option("--device", default=None, help="cpu | cuda | cuda:<index> (default: cuda when available)"),
    "repeats": option("--repeats", type=int, default=3, help="timed runs (the median is reported; default %(default)s)"),
    "json": option("--json", default=None, help="also write the results to this JSON file"),
    "policies": option("--policies", default=None,
                       help=f"comma list (default %(default)s; None: {common.DEFAULT_POLICIES}, less those that "
                            "cannot run at N)"),
    "length": option("--length", type=int, default=4096, help="prompt tokens L (default %(default)s)"),
    "budget": option("--budget", type=int, default=1024,
                     help="entries kept per layer and KV head, N (default %(default)s)"),
    "block_size": option("--block-size", type=int, default=128,
                         help="prompt tokens per prefill forward, B (default %(default)s)"),
    "new_tokens": option("--new-tokens", type=int, default=32, help="tokens decoded per sequence (default %(default)s)"),
}
RUN = ("model", "dtype", "attn", "threads", "device", "repeats", "json")  # what a case on a model takes
SIZES = ("length", "budget", "block_size")


@dataclass(frozen=True)
class Case:
    """A benchmark: `run(args)` returns the payload --json gets (or an exit status, or what its tests read);
    `check(args)` raises ValueError (one line) on a bad combination, before anything is built; `child(args)` is
    its measurement in a fresh process (`measure_in_child`), a JSON-able dict."""

    name: str
    run: Callable[[argparse.Namespace], Any]
    doc: str
    shared: tuple[str, ...] = RUN
    options: tuple = ()
    defaults: dict[str, Any] = field(default_factory=dict)
    check: Callable[[argparse.Namespace], None] | None = None
    child: Callable[[argparse.Namespace], dict] | None = None


def load(name: str) -> Case:
    if name not in CASES:
        exit_with_error(f"unknown case {name!r}; valid: {', '.join(CASES)} (usage: python -m keydiff.bench --help)")
    return importlib.import_module(f"keydiff.bench.{name}").CASE


def parser_of(case: Case, prog: str | None = None) -> ArgumentParser:
    """The one parser: the case's shared options, then its own, with its defaults."""
    parser = ArgumentParser(prog=prog, description=case.doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    for flags, settings in [SHARED[name] for name in case.shared] + list(case.options):
        parser.add_argument(*flags, **settings)
    parser.set_defaults(**case.defaults)
    return parser


def parse(case: Case, argv: list[str], prog: str | None = None) -> argparse.Namespace:
    """The case's arguments, checked (a mistake is one `error:` line, exit 2), with the device and dtype set."""
    parser = parser_of(case, prog)
    args = parser.parse_args(argv)
    try:
        if "device" in case.shared and args.device not in (None, "auto", "cpu") and not args.device.startswith("cuda"):
            raise ValueError(f"--device {args.device!r} is not valid; valid: cpu, cuda, cuda:<index>")
        if case.check:
            case.check(args)
        if getattr(args, "repeats", 1) < 1 or getattr(args, "new_tokens", 2) < 2:
            raise ValueError("--repeats must be >= 1 and --new-tokens >= 2")
        if "policies" in case.shared:  # args.names: the policies, each checked against the budget
            args.names = common.parse_policies(args.policies, args.budget)
    except ValueError as error:
        parser.error(str(error))
    return runtime(args)


def runtime(args: argparse.Namespace) -> argparse.Namespace:
    """Set --threads; args.device (--device, else cuda when available) and args.torch_dtype (--dtype, else the
    device's default)."""
    import torch

    if getattr(args, "threads", None):
        torch.set_num_threads(args.threads)
    if getattr(args, "device", None) in (None, "auto"):
        args.device = common.device_name()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        exit_with_error(f"--device {args.device}: no CUDA device is available")
    dtype = getattr(args, "dtype", None)
    args.torch_dtype = common.DTYPES[dtype] if dtype else common.default_dtype(args.device.split(":")[0])
    return args


def main(argv: list[str] | None = None, case: Case | None = None, module: str | None = None, **hooks: Any) -> Any:
    """`python -m keydiff.bench CASE [options]`, or with `case` given, `python -m <module> [options]` (the module's
    own command, recorded as such). Returns what the case's run (given `hooks`: tests') returns, having written a
    payload to --json."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if case is None:
        if argv[:1] == [CHILD]:
            return in_child(json.loads(argv[1]))
        if not argv or argv[0] in ("-h", "--help"):
            print(__doc__.split("\n\n")[0] + "\n\ncases: " + ", ".join(CASES)
                  + "\n\n`python -m keydiff.bench CASE --help` lists a case's options.")
            return 0
        case, argv, command = load(argv[0]), argv[1:], ["keydiff.bench", argv[0]]
    else:
        command = [module or f"keydiff.bench.{case.name}"]
    args = parse(case, argv, f"python -m {' '.join(command)}")
    args.started = common.provenance(command[0], command[1:] + argv)
    result = case.run(args, **hooks)
    if isinstance(result, dict):
        if args.json:
            common.write_json(args.json, result, args.started)
        return None
    return result


def command(main_function: Callable[[], Any]) -> None:
    """A command's end: exit with its run's status (0 unless it returned a number)."""
    result = main_function()
    sys.exit(result if isinstance(result, int) else 0)


def entry(case: Case, module: str, name: str) -> Callable[..., Any]:
    """A case module's `main(argv=None, **hooks)`: its case under its own command, `python -m <module>`; run as
    that command (name "__main__"), it runs at once."""
    def module_main(argv: list[str] | None = None, **hooks: Any) -> Any:
        return main(argv, case, module, **hooks)

    if name == "__main__":
        command(module_main)
    return module_main


def measure_in_child(case: str, args: argparse.Namespace, keep_failure: bool = False, **changes: Any) -> dict:
    """`case`'s child measurement of args (with `changes`) in a fresh `python -m keydiff.bench` process: the JSON it
    prints last. A failed child ends this run with its stderr's tail, or with keep_failure is {"failed": tail}."""
    values = {k: v for k, v in vars(args).items() if k not in ("started", "torch_dtype")}
    done = common.run_module("keydiff.bench", [CHILD, json.dumps({"case": case, "args": {**values, **changes}})])
    if done.returncode == 0:
        return json.loads(done.stdout.strip().splitlines()[-1])
    if keep_failure:
        return {"failed": done.stderr.strip()[-300:]}
    sys.exit(f"{case} {changes} failed in its own process:\n{done.stderr[-3000:]}")


def in_child(spec: dict) -> None:
    """The child's side of measure_in_child: one JSON line on stdout."""
    args = runtime(argparse.Namespace(**spec["args"]))
    print(json.dumps(load(spec["case"]).child(args)), flush=True)
