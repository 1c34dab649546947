"""Tables 19 and 2: time (and memory) of the eviction scoring step alone, per policy, vs N and B.

    python -m keydiff.bench scoring table19     # latency vs cache size 512..8192, / KeyDiff at 512, + paper (Android)
    python -m keydiff.bench scoring table2      # time and peak memory vs N and vs B, log-log, + stated complexities
    # options: --shape smollm2-135m|llama-3.2-3b|tiny  --device auto|cpu|cuda  --dtype  --threads  --repeats
    #          --warmup  --statistics fast|materialized  --policies  --block-size  --sizes / --budgets --blocks

Times one layer's eviction decision after a block as the cache runs it (the statistic the policy needs, then
`observe` and `evict_indices`), on random tensors of the model's head shape; median with interquartile range,
peak memory from a separate run. Output files carry a device tag and are rewritten on each run.

Design: docs/design/benchmarks.md#prefill-decode-throughput
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch

from keydiff.attention import attention_statistic, statistic_from_weights
from keydiff.bench import common, runner
from keydiff.config import STATISTICS_MODES
from keydiff.policies import build_policy
from keydiff.policies.base import LayerView

SHAPES = {"smollm2-135m": common.SMOLLM2_135M, "llama-3.2-3b": common.LLAMA_3_2_3B, "tiny": common.TINY}
POLICIES = ("keydiff", "tova", "h2o", "snapkv", "sink")
# Table 19 of the paper: relative latency of key scoring on an Android device (FP16), / KeyDiff at 512 KVs.
PAPER_TABLE19 = {
    "snapkv": [1.92, 2.46, 4.50, 8.94, 11.42],
    "tova": [1.02, 0.94, 1.25, 1.95, 3.06],
    "keydiff": [1.00, 1.03, 1.01, 1.07, 1.37],
    "h2o": [1.10, 0.99, 1.52, 2.32, 4.23],
}
PAPER_SIZES = [512, 1024, 2048, 4096, 8192]
# Table 2 of the paper: runtime and memory complexity in N (budget), B (block) and L (SnapKV's window).
COMPLEXITY = {
    "keydiff": ("O(N + B)", "O(N + B)", lambda n, b, w: n + b, lambda n, b, w: n + b),
    "tova": ("O(N + B)", "O(N + B)", lambda n, b, w: n + b, lambda n, b, w: n + b),
    "h2o": ("O(NB + B^2)", "O(NB + B^2)", lambda n, b, w: n * b + b * b, lambda n, b, w: n * b + b * b),
    "snapkv": ("O((N + B)L)", "O((N + B)L)", lambda n, b, w: (n + b) * w, lambda n, b, w: (n + b) * w),
    "sink": ("O(N)", "O(1)", lambda n, b, w: n, lambda n, b, w: 1.0),
}


def shape_of(name: str) -> tuple[int, int, int]:
    """(query heads, KV heads, head_dim) of a SHAPES entry."""
    config = SHAPES[name]
    return config["num_attention_heads"], config["num_key_value_heads"], common.head_dim(config)


class ScoringStep:
    """The inputs of one layer's scoring step and a callable that runs it (what keydiff.cache does per layer)."""

    def __init__(self, policy_name: str, budget: int, block: int, shape, statistics_mode: str, device, dtype,
                 seed: int = 0):
        heads, kv_heads, dim = shape
        self.policy = build_policy(policy_name)
        self.policy.validate(budget)
        self.budget, n = budget, budget + block
        generator = torch.Generator(device="cpu").manual_seed(seed)
        self.keys = torch.randn(1, kv_heads, n, dim, generator=generator).to(device, dtype)
        self.queries = torch.randn(1, heads, block, dim, generator=generator).to(device, dtype)
        self.positions = torch.arange(n, device=device).expand(1, kv_heads, n).contiguous()
        self.state = {name: torch.zeros(1, kv_heads, n, device=device) for name in self.policy.needs.state}
        self.rows = self.policy.needs.attention_rows
        self.scaling = dim ** -0.5
        self.weights = None
        if self.rows != 0 and statistics_mode == "materialized":
            keys = self.keys.repeat_interleave(heads // kv_heads, dim=1)
            logits = (self.queries @ keys.transpose(-1, -2)).float() * self.scaling
            visible = torch.ones(block, n, dtype=torch.bool, device=device).tril(diagonal=n - block)
            self.weights = logits.masked_fill(~visible, float("-inf")).softmax(-1).to(dtype)

    def __call__(self) -> torch.Tensor:
        attention = None
        if self.rows != 0:
            if self.weights is None:
                attention = attention_statistic(self.queries, self.keys, self.scaling, self.rows)
            else:
                attention = statistic_from_weights(self.weights, self.keys.shape[1], self.rows)
        view = LayerView(self.keys, self.keys, self.positions, attention, self.state, 0)
        if attention is not None:
            self.policy.observe(view)
        return self.policy.evict_indices(view, self.budget)


def time_step(step: ScoringStep, device: str, warmup: int, repeats: int) -> dict:
    times = common.timings(device, step, repeats, warmup)
    quartiles = statistics.quantiles(times, n=4) if len(times) > 1 else [times[0]] * 3
    return {"median_s": statistics.median(times), "q1_s": quartiles[0], "q3_s": quartiles[2], "repeats": repeats}


def peak_bytes(step: ScoringStep, device: str) -> int:
    """Peak bytes allocated by one scoring step beyond what existed before it."""
    if device == "cuda":
        common.sync(device)
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        step()
        common.sync(device)
        return int(torch.cuda.max_memory_allocated() - before)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    with tempfile.TemporaryDirectory() as folder:
        trace = Path(folder) / "trace.json"
        prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text())["traceEvents"]
    allocations = sorted((e["ts"], e["args"].get("Ev Idx", 0), e["args"]["Bytes"]) for e in events
                         if e.get("name") == "[memory]" and e["args"].get("Device Type", 0) == 0)
    running, peak = 0, 0
    for _, _, size in allocations:
        running += size
        peak = max(peak, running)
    return int(peak)


def measure(policies, points, args, device, dtype) -> list[dict]:
    """points: (N, B) pairs. One row per policy and point."""
    rows = []
    for policy in policies:
        for budget, block in points:
            step = ScoringStep(policy, budget, block, shape_of(args.shape), args.statistics, device, dtype)
            row = {"policy": policy, "N": budget, "B": block, **time_step(step, device, args.warmup, args.repeats),
                   "peak_bytes": peak_bytes(step, device)}
            rows.append(row)
            print(f"  {policy:8s} N={budget:6d} B={block:5d}  {row['median_s'] * 1e6:10.1f} us  "
                  f"{row['peak_bytes'] / 1024:10.1f} KiB", flush=True)
            del step
            common.release_memory(device)
    return rows


def device_tag(device: str) -> str:
    if device != "cuda":
        return "cpu"
    return "".join(ch if ch.isalnum() else "-" for ch in torch.cuda.get_device_name().lower()).strip("-")


def setting(args, device, dtype) -> dict:
    """What the timings depend on (the provenance record is added when the JSON is written)."""
    return {"setting": common.setting_line(device, dtype, shape=args.shape, statistics=args.statistics,
                                          warmup=args.warmup, repeats=args.repeats),
            "shape": dict(zip(("heads", "kv_heads", "head_dim"), shape_of(args.shape)))}


def table19(args, device, dtype, out: Path, started: dict) -> list[Path]:
    policies = args.policies or ["snapkv", "tova", "keydiff", "h2o", "sink"]
    rows = measure(policies, [(n, args.block_size) for n in args.sizes], args, device, dtype)
    base = next((r["median_s"] for r in rows if r["policy"] == "keydiff" and r["N"] == args.sizes[0]), None)
    for row in rows:
        row["relative"] = None if base is None else row["median_s"] / base
    tag = device_tag(device)
    header = "| method | " + " | ".join(str(n) for n in args.sizes) + " |"
    rule = "|---|" + "---:|" * len(args.sizes)
    cell = {(r["policy"], r["N"]): r for r in rows}
    ours = [f"| {p} | " + " | ".join(f"{cell[p, n]['relative']:.2f}" if base else "-" for n in args.sizes) + " |"
            for p in policies]
    absolute = [f"| {p} | " + " | ".join(f"{cell[p, n]['median_s'] * 1e6:.1f}" for n in args.sizes) + " |"
                for p in policies]
    paper = [f"| {p} | " + " | ".join(f"{v:.2f}" for v in values) + " |" for p, values in PAPER_TABLE19.items()]
    info = setting(args, device, dtype)
    text = "\n".join([
        f"# Table 19: scoring latency relative to KeyDiff at N = {args.sizes[0]} ({tag})", "",
        f"Ours: {info['setting']}, B = {args.block_size}. Median of {args.repeats} runs after {args.warmup} "
        "warm-up.", "",
        header, rule, *ours, "", "Absolute median (microseconds):", "", header, rule, *absolute, "",
        "Paper (Android smartphone, FP16, normalised by KeyDiff at 512 KVs):", "",
        "| method | " + " | ".join(str(n) for n in PAPER_SIZES) + " |", "|---|" + "---:|" * len(PAPER_SIZES),
        *paper, ""])
    import pandas as pd

    return write_table(out / f"table19_scoring_latency_{tag}", text, pd.DataFrame(rows), started,
                       {**info, "block_size": args.block_size, "results": rows,
                        "paper": {"sizes": PAPER_SIZES, "relative": PAPER_TABLE19}})


def write_table(stem: Path, text: str, frame, started: dict, payload: dict) -> list[Path]:
    """A table as markdown (`text`, also printed), CSV (`frame`) and JSON (`payload` with its provenance)."""
    paths = [stem.with_name(f"{stem.name}.{ext}") for ext in ("md", "csv", "json")]
    stem.parent.mkdir(parents=True, exist_ok=True)
    paths[0].write_text(text, encoding="utf-8")
    frame.to_csv(paths[1], index=False)
    common.write_json(paths[2], payload, started)
    print(text)
    return paths


def fitted_slope(x, y) -> float | None:
    import numpy as np

    x, y = np.asarray(x, float), np.asarray(y, float)
    keep = (x > 0) & (y > 0)
    return float(np.polyfit(np.log(x[keep]), np.log(y[keep]), 1)[0]) if keep.sum() >= 2 else None


def table2(args, device, dtype, out: Path, figures: Path, started: dict) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    import pandas as pd

    policies = args.policies or list(POLICIES)
    sweeps = {"N": [(n, args.block_size) for n in args.budgets], "B": [(args.budget, b) for b in args.blocks]}
    frames = []
    for axis, points in sweeps.items():
        print(f"sweep over {axis}:", flush=True)
        frames.append(pd.DataFrame(measure(policies, points, args, device, dtype)).assign(sweep=axis))
    df = pd.concat(frames, ignore_index=True)
    window = lambda policy: getattr(build_policy(policy), "window", 1)  # SnapKV's L  # noqa: E731
    fig, axes = plt.subplots(2, 2, figsize=(8.5, 6.5), layout="constrained")
    lines = [f"# Table 2: measured scoring cost vs N and B ({device_tag(device)})", "",
             f"{setting(args, device, dtype)['setting']}. Sweep over N at B = {args.block_size}; over B at N = "
             f"{args.budget}. Exponent = slope of a log-log least-squares fit (stated: the complexity's own slope "
             "over the same points).", "",
             "| method | runtime (paper) | memory (paper) | time exp. N (stated) | time exp. B (stated) | "
             "memory exp. N (stated) | memory exp. B (stated) |", "|---|---|---|---:|---:|---:|---:|"]
    for index, policy in enumerate(policies):
        runtime_text, memory_text, runtime_f, memory_f = COMPLEXITY[policy]
        cells = []
        for row, (metric, complexity) in enumerate((("median_s", runtime_f), ("peak_bytes", memory_f))):
            for column, axis in enumerate(("N", "B")):
                part = df[(df["policy"] == policy) & (df["sweep"] == axis)].sort_values(axis)
                x = part[axis].to_numpy(float)
                y = part[metric].to_numpy(float)
                stated = np.array([complexity(n, b, window(policy)) for n, b in zip(part["N"], part["B"])], float)
                ax = axes[row][column]
                ax.plot(x, np.maximum(y, 1e-12 if row == 0 else 1.0), "o-", color=f"C{index}", label=policy)
                if y[-1] > 0:  # the stated complexity, scaled to meet the measurement at the largest size
                    ax.plot(x, stated * y[-1] / stated[-1], "--", color=f"C{index}", alpha=0.6)
                cells.append((fitted_slope(x, y), fitted_slope(x, stated)))
        lines.append(f"| {policy} | {runtime_text} | {memory_text} | "
                     + " | ".join("-" if m is None or s is None else f"{m:.2f} ({s:.2f})" for m, s in cells)
                     + " |")
    for row, label in enumerate(("scoring time (s)", "peak extra memory (bytes)")):
        for column, axis in enumerate(("N (budget)", "B (block size)")):
            ax = axes[row][column]
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel(axis)
            ax.set_ylabel(label)
    axes[0][0].legend(fontsize=7, title="measured (solid)\nstated, scaled (dashed)", title_fontsize=7)
    fig.suptitle(f"scoring step per layer: {setting(args, device, dtype)['setting']}", fontsize=7)
    tag = device_tag(device)
    figures.mkdir(parents=True, exist_ok=True)
    fig.savefig(figures / f"table2_complexity_{tag}.png", metadata={"Software": None})
    plt.close(fig)
    paths = write_table(out / f"table2_complexity_{tag}", "\n".join(lines) + "\n", df, started,
                        {**setting(args, device, dtype), "budget": args.budget, "block_size": args.block_size,
                         "results": df.to_dict("records")})
    return paths + [figures / f"table2_complexity_{tag}.png"]


def int_list(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected a comma list of positive integers, got {text!r}")
    return values


def check(args) -> None:
    args.policies = [p.strip() for p in args.policies.split(",") if p.strip()] if args.policies else None
    unknown = [p for p in args.policies or [] if p not in POLICIES]
    if unknown:
        raise ValueError(f"unknown policies {unknown}; valid: {', '.join(POLICIES)}")
    if args.warmup < 0 or args.block_size < 1 or args.budget < 1:
        raise ValueError("--warmup must be >= 0; --repeats, --block-size and --budget >= 1")
    smallest = min(args.sizes + args.budgets + [args.budget])
    for policy in args.policies or POLICIES:  # SnapKV's window must fit the smallest budget
        try:
            build_policy(policy).validate(smallest)
        except ValueError as error:
            raise ValueError(f"{policy} at N = {smallest}: {error}") from None


def run(args) -> list[Path]:
    with torch.inference_mode():
        if args.table == "table19":
            paths = table19(args, args.device, args.torch_dtype, Path(args.out), args.started)
        else:
            paths = table2(args, args.device, args.torch_dtype, Path(args.out), Path(args.figures), args.started)
    print("wrote " + ", ".join(str(p) for p in paths))
    return paths


CASE = runner.Case("scoring", run, __doc__, ("dtype", "threads", "device", "repeats", "block_size", "budget"),
                   check=check, defaults={"repeats": 31, "budget": 2048}, options=(
    runner.option("table", choices=["table19", "table2"]),
    runner.option("--shape", default="smollm2-135m", choices=list(SHAPES), help="head shape (query/KV heads, dim)"),
    runner.option("--warmup", type=int, default=5),
    runner.option("--statistics", default="fast", choices=STATISTICS_MODES),
    runner.option("--policies", default=None, help=f"comma list from {', '.join(POLICIES)}"),
    runner.option("--sizes", type=int_list, default=PAPER_SIZES, help="table19: cache sizes N"),
    runner.option("--budgets", type=int_list, default=[256, 512, 1024, 2048, 4096, 8192], help="table2: N sweep"),
    runner.option("--blocks", type=int_list, default=[16, 32, 64, 128, 256, 512, 1024], help="table2: B sweep"),
    runner.option("--out", default=str(common.CHECKOUT / "results" / "tables")),
    runner.option("--figures", default=str(common.CHECKOUT / "results" / "figures" / "analysis"))))


main = runner.entry(CASE, __spec__.name, __name__)  # `python -m keydiff.bench scoring`: this case
