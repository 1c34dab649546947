"""What the benchmarks, the GPU self-check and the analyses share: model shapes, the device setting,
memory, and the one provenance record (`provenance`, `write_json`) every JSON output of them carries.

Random models (public architecture configs, no download) stand in for real checkpoints: speed and memory depend
on shapes, not weights.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from keydiff import available_policies, build_policy, openmp
from keydiff.device import release_memory, sync  # noqa: F401 (the benches' names)
from keydiff.run.memory import (  # noqa: F401 (the benches' names)
    current_rss_bytes, peak_memory, peak_rss_bytes, reset_peak, reset_peak_rss,
)
from keydiff.run.provenance import provenance_record, timestamp

# Llama-3.2-3B(-Instruct), from its public config.json.
LLAMA_3_2_3B = dict(
    vocab_size=128256, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
    num_key_value_heads=8, head_dim=128, max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
    rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192},
    tie_word_embeddings=True, bos_token_id=128000, eos_token_id=[128001, 128008, 128009],
)
# SmolLM2-135M, from its public config.json; positions extended so 16k-token prompts are valid.
SMOLLM2_135M = dict(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
    num_key_value_heads=3, head_dim=64, max_position_embeddings=32768, rms_norm_eps=1e-5, rope_theta=100000.0,
    tie_word_embeddings=True,
)
# The test suite's tiny Llama (tests/conftest.py): 3 layers, GQA group of 2, head_dim 16.
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=32768)
# A mid-size shape for GPU checks: enough layers and heads for bf16 rounding to accumulate.
MID = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
           num_key_value_heads=4, head_dim=64, max_position_embeddings=32768)
RANDOM_MODELS = {"random-tiny": TINY, "random-mid": MID, "random-smollm2": SMOLLM2_135M,
                 "random-llama-3.2-3b": LLAMA_3_2_3B}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_POLICIES = "full,keydiff,sink,knorm,tova,snapkv,h2o"
# The folder that holds this keydiff package (a checkout's root).
CHECKOUT = Path(__file__).resolve().parents[2]


def device_name() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def default_dtype(device: str) -> torch.dtype:
    return torch.bfloat16 if device == "cuda" else torch.float32


def build_model(name: str, dtype: torch.dtype, attn: str, device: str, seed: int = 0, positions: int = 0):
    """A random model from RANDOM_MODELS (its positions extended to `positions` where that is more), or a real one
    through keydiff.models (smollm2-135m, hub ids)."""
    if name in RANDOM_MODELS:
        shape = RANDOM_MODELS[name]
        torch.manual_seed(seed)
        with torch.device(device):
            config = LlamaConfig(**{**shape, "max_position_embeddings": max(positions, shape["max_position_embeddings"])})
            model = LlamaForCausalLM._from_config(config, attn_implementation=attn, dtype=dtype)
        return model.eval()
    from keydiff.models import ModelConfig, load_model

    cfg = ModelConfig.from_dict({"name": name, "path": "builtin:smollm2-135m" if name == "smollm2-135m" else name,
                                 "dtype": {v: k for k, v in DTYPES.items()}[dtype], "attn_implementation": attn,
                                 "max_length": 1 << 20, "device": device})
    cfg.validate()
    return load_model(cfg)[0]


def model_and_prompt(args, name: str | None = None, positions: int = 0) -> tuple[Any, torch.Tensor]:
    """A case's model (`name`, else --model; --dtype and --attn, on its device) and a random prompt of --length
    tokens (`random_prompt`, seed 0) there."""
    model = build_model(name or args.model, args.torch_dtype, args.attn, args.device, positions=positions)
    return model, random_prompt(model, args.length).to(args.device)


def parse_policies(text: str | None, budget: int, default: str = DEFAULT_POLICIES) -> list[str]:
    """Policy names from a comma list, each validated against the budget before any model is loaded. text=None means
    `default`, from which policies that cannot run at this budget (SnapKV's 32-token window needs N > 32) are dropped
    with a note; a policy asked for by name raises ValueError (one line) instead."""
    names = [p.strip() for p in (text or default).split(",") if p.strip()]
    unknown = [p for p in names if p not in available_policies()]
    if unknown:
        raise ValueError(f"unknown policies {unknown}; valid: {', '.join(available_policies())}")
    valid = []
    for name in names:
        try:
            build_policy(name).validate(budget)
            valid.append(name)
        except ValueError as error:
            if text is not None:
                raise ValueError(f"{name}: {error}") from None
            print(f"note: {name} skipped: {error}", file=sys.stderr)
    return valid


def setting_line(device: str, dtype: torch.dtype | None, **fields) -> str:
    """One line naming everything a timing depends on: device, threads, dtype, the run's settings and the
    OpenMP variables torch started with (keydiff.openmp)."""
    hardware = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    parts = [f"device={hardware}", f"threads={torch.get_num_threads()}", f"torch={torch.__version__}"]
    if dtype is not None:
        parts.insert(2, f"dtype={str(dtype).removeprefix('torch.')}")
    variables = openmp.describe()
    return " ".join(parts + [f"{k}={v}" for k, v in fields.items()] + ([variables] if variables else []))


def random_prompt(model, length: int, seed: int = 0) -> torch.Tensor:
    vocab = model.config.get_text_config().vocab_size
    return torch.randint(0, vocab, (1, length), generator=torch.Generator().manual_seed(seed))


def prompt_record(prompt: torch.Tensor, seed: int = 0) -> dict[str, Any]:
    """The data a benchmark ran on: random token ids (`random_prompt`), their seed, length and sha256."""
    ids = prompt.detach().cpu().to(torch.int64).contiguous().numpy().tobytes()
    return {"prompt": "random token ids", "seed": seed, "tokens": prompt.shape[-1],
            "sha256": hashlib.sha256(ids).hexdigest()}


def run_module(module: str, arguments: list[str]) -> subprocess.CompletedProcess:
    """`python -m module arguments` in a fresh interpreter (a clean process for memory peaks), importing this same
    keydiff (CHECKOUT first on its PYTHONPATH) and running in the caller's folder, so relative paths hold."""
    path = os.pathsep.join(filter(None, [str(CHECKOUT), os.environ.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-m", module, *arguments], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": path})


def timed(device: str, fn: Callable[[], Any]) -> tuple[float, Any]:
    """Seconds fn() takes, the device synchronised before and after (so they count its queued work), and its result:
    the one timer of every benchmark."""
    sync(device)
    start = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - start, out


def timings(device: str, fn: Callable[[], Any], repeats: int, warm_up: int = 0) -> list[float]:
    """Seconds of `repeats` timed calls of fn() (`timed`), after `warm_up` untimed ones."""
    for _ in range(warm_up):
        fn()
    return [timed(device, fn)[0] for _ in range(repeats)]


def rss_of(fn: Callable[[], Any]) -> dict[str, Any]:
    """The peak RSS (VmHWM) of fn()'s run alone where this OS can reset the peak (`peak_is_run_only`; else of the
    whole process), and the RSS before it: what a child of `runner.measure_in_child` reports of itself."""
    reset = reset_peak_rss()
    before = current_rss_bytes()
    fn()
    return {"peak_rss_bytes": peak_rss_bytes(), "rss_after_load_bytes": before, "peak_is_run_only": reset}


def interleaved_rounds(cases: dict[str, Callable[[], Any]], repeats: int, device: str,
                       warm_up: bool = True) -> dict[str, list[Any]]:
    """Run every case once untimed (unless warm_up=False), then `repeats` rounds in which each case runs once, in
    turn: rounds spread the machine's speed drift over every case instead of into their ratios. Memory is released
    between cases."""
    runs = [("warm-up", name) for name in cases] if warm_up else []
    runs += [(f"round {r + 1}/{repeats}", name) for r in range(repeats) for name in cases]
    plan = "one untimed warm-up run of each, then " if warm_up else ""
    progress = Progress(f"{len(cases)} case(s): {plan}{repeats} timed round(s)", len(cases))
    results: dict[str, list[Any]] = {name: [] for name in cases}
    for index, (phase, name) in enumerate(runs):
        progress.start(f"{phase}: {name}", [n for _, n in runs[index:]])
        release_memory(device)
        measured = cases[name]()
        progress.done(name)
        if phase != "warm-up":
            results[name].append(measured)
    return results


def minutes(seconds: float) -> str:
    """A duration as a person reads it: "40 s", "4.2 min"."""
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.1f} min"


class Progress:
    """Lines on stderr saying which run of a benchmark starts and about how long is left.

    Each pending run costs what the last run of its name took; a name not run yet, the mean of those timed."""

    def __init__(self, plan: str, names: int):
        self.took: dict[str, float] = {}
        self.names = names
        self.began = time.perf_counter()
        print(f"  {plan}; the time left is estimated from the first run on", file=sys.stderr, flush=True)

    def left(self, pending: list[str]) -> float | None:
        """Seconds the `pending` runs (names, this one included) will take; None before any run is timed."""
        if not self.took:
            return None
        mean = sum(self.took.values()) / len(self.took)
        return sum(self.took.get(name, mean) for name in pending)

    def start(self, label: str, pending: list[str]) -> None:
        left = self.left(pending)
        estimate = "" if left is None else f" (about {minutes(left)} left; {len(self.took)} of {self.names} timed)"
        print(f"  {label} ...{estimate}", file=sys.stderr, flush=True)
        self.began = time.perf_counter()

    def done(self, name: str) -> float:
        """Seconds since `start`, kept as the time of `name`'s next run."""
        self.took[name] = time.perf_counter() - self.began
        return self.took[name]


def kv_cache_bytes(cache, model, entries: int, batch: int = 1) -> int:
    """Bytes the cache's key/value buffers hold: the cache's own count when it has one, else the formula
    2 (K and V) x layers x KV heads x head_dim x itemsize x entries x batch."""
    own = getattr(cache, "kv_cache_bytes", None)
    if own is not None:
        return int(own)
    config = model.config.get_text_config()
    itemsize = next(model.parameters()).element_size()
    return 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim(config) * itemsize * entries * batch


def head_dim(config) -> int:
    """A (text) model config's or a RANDOM_MODELS shape's head dimension."""
    get = config.get if isinstance(config, dict) else lambda key: getattr(config, key, None)
    return get("head_dim") or get("hidden_size") // get("num_attention_heads")


def provenance(module: str, argv: list[str] | None = None) -> dict[str, Any]:
    """What produced a benchmark's or an analysis's numbers, taken when it starts: keydiff.run.provenance's record,
    the command line as `python -m module args` and the start time (`write_json` adds the end time). Pass the entry
    point's `__spec__.name`, which names the module however it was started."""
    arguments = sys.argv[1:] if argv is None else list(argv)
    record = provenance_record([module, *arguments])
    record["command"] = shlex.join(["python", "-m", module, *arguments])
    record["started"] = record.pop("time")
    return record


def write_json(path: str | Path, payload: dict[str, Any], started: dict[str, Any]) -> Path:
    """Write results with their provenance (`provenance()` at the start) and the end time, creating the folder.
    Written to a temporary file and moved into place, so a run killed while writing keeps the previous file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {**payload, **started, "time": timestamp()}
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(record, indent=2, default=str) + "\n", encoding="utf-8")
    os.replace(partial, path)
    return path


def first_line(error: BaseException, limit: int = 300) -> str:
    """An exception as one line: its type and its message's first line (what a failed row records)."""
    return f"{type(error).__name__}: {(str(error).splitlines() or [''])[0]}"[:limit]


class RowLog:
    """The rows of a command that measures for minutes (make gpu-bench, make gpu-check), kept as each finishes:
    `add` prints the row as one line (`line(row)`) and rewrites the JSON (if `path`) with every row so far, so a
    failure or a kill keeps every row finished before it. `payload()` gives the JSON's other fields."""

    def __init__(self, path: str | Path | None, started: dict[str, Any], payload: Callable[[], dict[str, Any]],
                 line: Callable[[dict[str, Any]], str]):
        self.path, self.started, self.payload, self.line = path, started, payload, line
        self.rows: list[dict[str, Any]] = []

    def add(self, row: dict[str, Any]) -> dict[str, Any]:
        self.rows.append(row)
        print(self.line(row), flush=True)
        self.write()
        return row

    def write(self) -> None:
        if self.path:
            write_json(self.path, {**self.payload(), "rows": self.rows}, self.started)


def ratio(value: float | None, base: float | None) -> float | None:
    return None if value is None or not base else value / base


def fmt(value: float | None, spec: str, suffix: str = "") -> str:
    """Format a number, or '-' where it does not apply."""
    return "-" if value is None else f"{value:{spec}}{suffix}"


def print_table(columns: list[tuple[str, int]], rows: list[list[str]], text_columns: int = 1) -> None:
    """The first `text_columns` columns left-aligned, the numbers after them right-aligned; widths fit."""
    widths = [max([w, len(title)] + [len(row[i]) for row in rows]) for i, (title, w) in enumerate(columns)]
    line = lambda cells: "".join(c.ljust(w + 2) if i < text_columns else c.rjust(w + 2)
                                 for i, (c, w) in enumerate(zip(cells, widths))).rstrip()
    print(line([title for title, _ in columns]))
    for row in rows:
        print(line(row))
