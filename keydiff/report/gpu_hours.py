"""GPU hours of the paper's experiments, computed from GPU rates measured on Llama-3.2-3B's shape (`make gpu-hours`).

    python -m keydiff.report.gpu_hours [--rates results/bench/gpu_bench.json]

The default rates (results/bench/gpu_rates_h200.json) name the measurement each comes from; `--rates` takes such a
file or a `make gpu-bench` JSON, whose rows replace the rates they measure. One grid point takes samples x scale x
(prompt / prefill rate x p + generated x ms per token / 1000 x d / speed-up) (see `Rates`); scale extrapolates
from the 3B shape by weight bytes. The grids are keydiff.grids'; the workloads are the data below. Imports no
torch. The formula, its assumptions and the table: docs/gpu.md#devices-kernels-memory-and-gpu-hours
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from keydiff.cli import ArgumentParser, exit_with_error
from keydiff.grids import CONF, experiment_grid

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_RATES = ROOT / "results" / "bench" / "gpu_rates_h200.json"

MEASURED = "random-llama-3.2-3b"  # the shape every rate was measured on (keydiff.bench.common)
# bf16 weights (GB), docs/gpu.md "Memory" table (parameters x 2 bytes); the measured shape is Llama-3.2-3B's.
WEIGHTS_GB = {
    MEASURED: 6.4,
    "llama-3.2-3b-instruct": 6.4,
    "qwen2.5-3b-instruct": 6.2,
    "qwen2.5-7b-instruct": 15.2,
    "llama-3.1-8b-instruct": 16.1,
    "deepseek-r1-distill-llama-8b": 16.1,
    "deepseek-r1-distill-qwen-7b": 15.2,
}
# Every conf/policy preset's needs (keydiff.policies.capabilities), read as data: importing the policies needs torch.
CAPABILITIES = Path(__file__).resolve().parents[1] / "policies" / "capabilities.json"


@lru_cache(maxsize=1)
def file_needs() -> dict[str, dict[str, Any]]:
    return json.loads(CAPABILITIES.read_text(encoding="utf-8"))


@lru_cache(maxsize=None)
def preset_needs(policy: str) -> dict[str, Any]:
    """The preset's row of capabilities.json ({} for a name no conf/policy file has). A preset the file lacks (a
    policy added since it was written) is computed, which imports the policies (torch); the presets the paper's
    experiments run are in the file (tests/test_capabilities.py), so the command itself imports none."""
    table = file_needs()
    if policy in table or policy == "custom" or not (CONF / "policy" / f"{policy}.yaml").exists():
        return table.get(policy, {})
    from keydiff.policies.capabilities import capabilities

    return capabilities([policy])[policy]


def capturable(policy: str) -> bool:
    """Needs.capturable: the preset runs the fixed-shape step where the rates have one (besides `pooled` ones: TOVA,
    SnapKV and H2O at batch 1; batched, their rows decode each alone on the ordinary step). full never does."""
    return bool(preset_needs(policy).get("capturable"))


def pooled(policy: str) -> bool:
    """Capturable and Needs.groupable: the preset scores from its entries alone, so its rows pool into one block at
    any batch (keydiff.decode.blocks.poolable), timed as KeyDiff's."""
    return capturable(policy) and bool(preset_needs(policy)["groupable"])


def measured_as(policy: str) -> str:
    """The policy whose measured cost ratio stands for this one: KeyDiff for its pooled variants (the same class,
    other parameters), else itself."""
    return "keydiff" if pooled(policy) and policy.startswith("keydiff") else policy


STEPS = ("ordinary", "fixed")
KINDS = ("grouped", "per row", "full")  # how a batch's rows decode (Rates.speedup)


@dataclass(frozen=True)
class Task:
    name: str  # the conf/task the experiments compose
    label: str
    samples: int  # per grid point
    prompt: int  # mean prompt tokens per sample
    generated: int  # mean generated tokens per sample
    source: str
    datasets: int | None = None  # LongBench: how many of its datasets (checked against the composed task)


LONGBENCH_NOTE = ("LongBench v1's test sets (200 samples each; multifieldqa_en 150, lcc and repobench-p 500); "
                  "~9K prompt tokens and ~80-90 generated are the earlier docs/gpu.md's assumptions, not measured "
                  "(the per-dataset caps of keydiff/tasks/longbench.py allow 136 / 141 on average)")
MATH_NOTE = ("500 problems x 5 sampled responses (conf/task/math500.yaml); ~150 prompt tokens (earlier docs' "
             "assumption); generated: the mean of the paper's avg_gen_length over its Tables 4 and 6 "
             "(results/paper/table4.csv, table6.csv) at this limit")
LONGBENCH_16 = Task("longbench", "LongBench (16)", 3750, 9000, 80, LONGBENCH_NOTE, datasets=16)
LONGBENCH_21 = Task("longbench_full", "LongBench (21)", 4750, 9000, 90, LONGBENCH_NOTE, datasets=21)
LONGBENCH_20 = Task("longbench_full", "LongBench (20: no narrativeqa)", 4550, 9000, 90, LONGBENCH_NOTE, datasets=20)
MATH_4K = Task("math500", "Math-500 4K", 2500, 150, 2702, MATH_NOTE)
MATH_8K = Task("math500_8k", "Math-500 8K", 2500, 150, 3569, MATH_NOTE)
MATH_32K = Task("math500_32k", "Math-500 32K", 2500, 150, 5608, MATH_NOTE)
NIAH = Task("niah", "NIAH", 100, 15500, 20, "10 lengths x 10 depths (conf/task/niah.yaml), the mean length; "
            "~20 generated (earlier docs' assumption; capped at 50)")
NIAH_16K = Task("niah", "NIAH 16K", 5, 16384, 20, "one length x 5 depths (the experiment's override); ~20 generated")
PHONEBOOK = Task("phonebook", "phonebook", 50, 36000, 20, "10 book sizes x 5 books (conf/task/phonebook.yaml); "
                 "~36K prompt tokens (earlier docs' assumption for the mean book); capped at 20 generated")


WORKLOADS = (LONGBENCH_16, LONGBENCH_21, LONGBENCH_20, MATH_4K, MATH_8K, MATH_32K, NIAH, NIAH_16K, PHONEBOOK)
# The paper's experiments in the table's order (their grids: conf/experiment, through keydiff.grids).
PAPER_EXPERIMENTS = ("table1", "table1_full", "table10", "table11", "table11_full", "table12", "table12_full",
                     "table13", "table14", "table15", "table16", "table4_gen4k", "table4_gen8k", "table4_gen32k",
                     "table4_full", "fig6_niah", "fig7_ttft", "fig17_ttft_eager", "table17")
BATCH_1_ONLY = frozenset({"fig7_ttft", "fig17_ttft_eager"})  # timing runs (TTFT): batch 1 whatever the others do


def workload(task: Any) -> Task:
    """The workload of a composed task config: by its name, LongBench's by its number of datasets, NIAH's by its
    number of prompts (lengths x depths)."""
    def fits(candidate: Task) -> bool:
        if candidate.name != str(task.name):
            return False
        if candidate.datasets is not None:
            return len(task.datasets) == candidate.datasets
        if candidate.name == "niah":
            return len(task.context_lengths) * len(task.depths) == candidate.samples
        return True

    found = [candidate for candidate in WORKLOADS if fits(candidate)]
    if len(found) != 1:
        raise ValueError(f"no workload for task {task.name!r} as composed here; workloads: "
                         f"{', '.join(t.label for t in WORKLOADS)}")
    return found[0]


@dataclass(frozen=True)
class Experiment:
    """One experiment's grid points (keydiff.grids) as the estimate times them: (task, model, policy) each."""

    name: str
    points: tuple[tuple[Task, str, str], ...]
    batch_1_only: bool = False

    @property
    def tasks(self) -> tuple[Task, ...]:
        return tuple(dict.fromkeys(task for task, _, _ in self.points))


def experiment(name: str) -> Experiment:
    """conf/experiment/<name>.yaml's grid, each point's workload read from the task it composes."""
    from hydra import compose, initialize_config_dir

    points, composed = [], {}
    for point in experiment_grid(name):
        key = tuple(o for o in point if o.split("=", 1)[0] in ("experiment", "task") or o.startswith("task."))
        if key not in composed:
            with initialize_config_dir(str(CONF), version_base="1.3"):
                composed[key] = compose("config", overrides=list(key), return_hydra_config=True)
        cfg = composed[key]
        axes = dict(o.split("=", 1) for o in point)
        choices = cfg.hydra.runtime.choices
        points.append((workload(cfg.task), axes.get("model", choices.model), axes.get("policy", choices.policy)))
    return Experiment(name, tuple(points), name in BATCH_1_ONLY)


@lru_cache(maxsize=1)
def paper_experiments() -> tuple[Experiment, ...]:
    return tuple(experiment(name) for name in PAPER_EXPERIMENTS)


class RatesError(ValueError):
    """A rates file that cannot give a rate the table needs: the message names the file and what is missing."""


@dataclass(frozen=True)
class Rate:
    value: float
    source: str


@dataclass(frozen=True)
class Rates:
    """What a GPU measured on MEASURED's shape, and where each number comes from.

    prefill[step]: prompt tokens/s at B = 128; decode[step]: ms per generated token at batch 1 (steps: "ordinary",
    and "fixed" where measured). speedup[kind][batch]: tokens/s at that batch over batch 1, kind "grouped" (a run's
    rows pooled into one arena, where measured), "per row" (own buffers) or "full" (no eviction, each row alone).
    ratios[phase][policy]: time against full on the ordinary step (gpu-check's TTFT and ms/token rows)."""

    path: Path
    device: str
    setting: str
    code: str
    date: str
    prefill: dict[str, Rate]
    decode: dict[str, Rate]
    speedup: dict[str, dict[int, Rate]]
    ratios: dict[str, dict[str, float]]
    ratio_source: str
    borrowed: list[str] = field(default_factory=list)  # what came from another rates file (and which)

    def step(self, policy: str) -> str:
        return "fixed" if capturable(policy) and "fixed" in self.decode else "ordinary"

    def kind(self, policy: str) -> str:
        if policy == "full":
            return "full"
        return "grouped" if pooled(policy) and "grouped" in self.speedup else "per row"

    def factors(self, policy: str) -> tuple[float, float]:
        """(prefill, decode) cost against KeyDiff's: gpu-check's ratios, which were measured on the ordinary step
        (a `pooled` policy on the fixed step is timed as KeyDiff's fixed step; an attention-statistic one keeps its
        ratio, an assumption until gpu-bench times it)."""
        if self.step(policy) == "fixed" and pooled(policy):
            return 1.0, 1.0
        name = measured_as(policy)
        found = []
        for phase in ("prefill", "decode"):
            ratios = self.ratios[phase]
            if name not in ratios:
                raise RatesError(f"{self.path}: no {phase} ratio for policy {name!r} in policy_ratios "
                                 f"(has: {', '.join(sorted(ratios))})")
            found.append(ratios[name] / ratios["keydiff"])
        return found[0], found[1]


def read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise RatesError(f"{path}: no such file (a rates file such as {DEFAULT_RATES.relative_to(ROOT)} or a "
                         f"`make gpu-bench` result)")
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise RatesError(f"{path}: not JSON ({error})") from None
    if not isinstance(record, dict):
        raise RatesError(f"{path}: not a JSON object")
    return record


def entry(path: Path, record: dict, *keys: str) -> Any:
    """record[k1][k2]..., or a RatesError naming the missing key's place."""
    value: Any = record
    for depth, key in enumerate(keys):
        if not isinstance(value, dict) or key not in value:
            raise RatesError(f"{path}: missing {'.'.join(keys[:depth + 1])}")
        value = value[key]
    return value


def positive(path: Path, value: Any, what: str) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
        raise RatesError(f"{path}: {what} is {value!r}, not a positive number")
    return float(value)


def rate(path: Path, record: dict, *keys: str) -> Rate:
    value = positive(path, entry(path, record, *keys, "value"), ".".join(keys) + ".value")
    return Rate(value, str(entry(path, record, *keys, "source")))


def from_rates_file(record: dict, path: Path) -> Rates:
    """A rates file (results/bench/gpu_rates_h200.json's format): the ordinary step, 'per row' and 'full' are
    required; a 'fixed' step and 'grouped' speed-ups are read where the file has them."""
    model = entry(path, record, "model")
    if model != MEASURED:
        raise RatesError(f"{path}: rates of model {model!r}; the scaling to the paper's models starts from {MEASURED}")
    steps = [s for s in STEPS if s == "ordinary" or s in entry(path, record, "decode_ms_per_token")]
    speedup = {}
    for kind in (k for k in KINDS if k != "grouped" or k in entry(path, record, "speedup")):
        source = str(entry(path, record, "speedup", kind, "source"))
        given = {b: v for b, v in entry(path, record, "speedup", kind).items() if b != "source"}
        if not given or not all(b.isdigit() and int(b) > 1 for b in given):
            raise RatesError(f"{path}: speedup.{kind} needs batch sizes > 1 as keys (\"8\": 4.58), not {list(given)}")
        speedup[kind] = {int(b): Rate(positive(path, v, f"speedup.{kind}.{b}"), source) for b, v in given.items()}
    ratios = {}
    for phase in ("prefill", "decode"):
        ratios[phase] = {p: positive(path, v, f"policy_ratios.{phase}.{p}")
                         for p, v in entry(path, record, "policy_ratios", phase).items()}
        entry(path, record, "policy_ratios", phase, "keydiff")  # the base every other ratio is divided by
    return Rates(path, entry(path, record, "device"), entry(path, record, "setting"), entry(path, record, "code"),
                 entry(path, record, "date"),
                 {s: rate(path, record, "prefill_tokens_per_s", s) for s in steps},
                 {s: rate(path, record, "decode_ms_per_token", s) for s in steps},
                 speedup, ratios, entry(path, record, "policy_ratios", "source"))


def from_gpu_bench(record: dict, path: Path, base: Rates) -> Rates:
    """A `make gpu-bench` result (keydiff.bench.gpu_bench's JSON): its decode, prefill and full rows give the
    fixed and ordinary steps, the grouped speed-up and full's; 'per row' and the policy ratios, which it does
    not measure, come from `base`. Its code pools a run's rows into one arena (keydiff.decode.Decoder)."""
    sizes = record.get("sizes") or {}
    if record.get("device") != "cuda" or sizes.get("model") != MEASURED:
        raise RatesError(f"{path}: a gpu_bench result on {record.get('device')!r} with model {sizes.get('model')!r}; "
                         f"the rates need the full run on CUDA (model {MEASURED}), not --quick")
    rows = [row for row in record.get("rows", []) if "error" not in row]
    name = path.name

    def find(**match: Any) -> dict:
        for row in rows:
            if all(row.get(k) == v for k, v in match.items()):
                return row
        wanted = ", ".join(f"{k}={v}" for k, v in match.items())
        raise RatesError(f"{path}: no gpu_bench row with {wanted} (failed or skipped in that run?)")

    def ms(case: str, batch: int) -> float:
        found = find(row="decode", case=case, batch=batch).get("ms_per_step_steady")
        return positive(path, found, f"decode row {case!r} at batch {batch}: ms_per_step_steady")

    big, block = entry(path, record, "sizes", "batch"), entry(path, record, "sizes", "block")
    length = entry(path, record, "sizes", "prefill_lengths")[0]
    prefill, decode = {}, {}
    for step in STEPS:
        found = find(row="prefill", case=f"keydiff {step}", L=length, B=block).get("seconds")
        seconds = positive(path, found, f"prefill row 'keydiff {step}' at L = {length}, B = {block}: seconds")
        prefill[step] = Rate(length / seconds, f"{name}: keydiff {step} prefill of L = {length:,} at B = {block} in "
                                               f"{seconds:.2f} s")
        decode[step] = Rate(ms(f"keydiff {step}", 1), f"{name}: keydiff {step} at batch 1, steady steps")
    fixed_big = ms("keydiff fixed", big)
    grouped = Rate(big * decode["fixed"].value / fixed_big,
                   f"{name}: keydiff fixed, {big} forks in one block, {fixed_big:.2f} ms per step over batch 1")
    full_big = ms("full (ours)", big)
    full_one = decode["ordinary"].value * base.factors("full")[1]  # full's batch 1: not a gpu_bench row
    full = Rate(big * full_one / full_big, f"{name}: full (ours) at batch {big}, {full_big:.2f} ms per step, over "
                                           f"keydiff ordinary's batch 1 x gpu-check's full / keydiff ({full_one:.1f} ms)")
    code = record.get("code") or {}
    commit = str(code.get("commit", "?"))[:7] + (" (dirty)" if code.get("dirty") else "")
    device = (record.get("environment") or {}).get("cuda_device", "cuda")
    return Rates(path, device, f"{MEASURED}, bf16, sdpa ({record.get('command', 'gpu_bench')})", commit,
                 str(record.get("started", "?"))[:10], prefill, decode,
                 {"grouped": {big: grouped}, "per row": base.speedup["per row"], "full": {big: full}},
                 base.ratios, base.ratio_source,
                 [f"'per row' speed-ups and the policy ratios: {relative(base.path)} ({base.device}, "
                  f"code {base.code})"])


def load_rates(path: Path = DEFAULT_RATES, base: Path = DEFAULT_RATES) -> Rates:
    record = read_json(path)
    if "rows" in record:
        return from_gpu_bench(record, path, load_rates(base, base))
    return from_rates_file(record, path)


def point_seconds(task: Task, model: str, policy: str, rates: Rates, batch: int) -> float:
    """One grid point's seconds on one GPU (the module's formula)."""
    step, kind = rates.step(policy), rates.kind(policy)
    prefill_factor, decode_factor = rates.factors(policy)
    scale = WEIGHTS_GB[model] / WEIGHTS_GB[MEASURED]
    speedup = 1.0 if batch == 1 else rates.speedup[kind][batch].value
    # Batched, an attention-statistic policy's rows decode each on its own, on the ordinary step (its prefill, alone,
    # takes the fixed step).
    decode_step = step if batch == 1 or pooled(policy) else "ordinary"
    prefill_s = task.prompt / rates.prefill[step].value * prefill_factor
    decode_s = task.generated * rates.decode[decode_step].value / 1000 * decode_factor / speedup
    return task.samples * scale * (prefill_s + decode_s)


def experiment_hours(experiment: Experiment, rates: Rates, batch: int) -> float:
    batch = 1 if experiment.batch_1_only else batch
    return sum(point_seconds(t, m, p, rates, batch) for t, m, p in experiment.points) / 3600


def batches(rates: Rates) -> list[int]:
    """The batch sizes every way of decoding the experiments use was measured at."""
    kinds = {rates.kind(p) for e in paper_experiments() if not e.batch_1_only for _, _, p in e.points}
    return sorted(set.intersection(*(set(rates.speedup[kind]) for kind in kinds)))


def relative(path: Path) -> str:
    """A path inside the checkout relative to it (as the docs name it), any other as given."""
    resolved = path.resolve()
    return str(resolved.relative_to(ROOT)) if resolved.is_relative_to(ROOT) else str(path)


def hours_text(hours: float) -> str:
    """Two significant digits (three from 1,000): the workloads are rough means, so more would claim too much."""
    if hours < 1:
        return "< 1"
    rounded = float(f"{hours:.{2 if hours < 1000 else 3}g}")
    return f"{rounded:,.{1 if rounded < 10 else 0}f}"


def table_lines(rates: Rates) -> list[str]:
    sizes = batches(rates)
    lines = ["| experiment | task | grid points | samples / point | batch 1 | "
             + " | ".join(f"batch {b}" for b in sizes) + " |",
             "|---|---|---|---|---|" + "---|" * len(sizes)]
    totals = [0.0] * (1 + len(sizes))
    for experiment in paper_experiments():
        hours = [experiment_hours(experiment, rates, b) for b in (1, *sizes)]
        totals = [t + h for t, h in zip(totals, hours)]
        tasks = " / ".join(dict.fromkeys(t.label for t in experiment.tasks))
        samples = " / ".join(dict.fromkeys(f"{t.samples:,}" for t in experiment.tasks))
        shown = [hours_text(hours[0])] + [hours_text(h) + (" (batch 1)" if experiment.batch_1_only else "")
                                          for h in hours[1:]]
        lines.append(f"| `{experiment.name}` | {tasks} | {len(experiment.points)} | {samples} | "
                     + " | ".join(shown) + " |")
    points = sum(len(e.points) for e in paper_experiments())
    lines.append(f"| all | | {points} | | " + " | ".join(f"**{hours_text(t)}**" for t in totals) + " |")
    return lines


def rate_lines(rates: Rates) -> list[str]:
    lines = [f"Rates: {rates.device}, {rates.setting}; code {rates.code}; {rates.date} ({relative(rates.path)}):"]
    for step, r in rates.prefill.items():
        lines.append(f"* prefill, {step} step: {r.value:,.0f} prompt tokens/s ({r.source})")
    for step, r in rates.decode.items():
        lines.append(f"* decode at batch 1, {step} step: {r.value:.1f} ms per token ({r.source})")
    for kind, by_batch in rates.speedup.items():
        shown = ", ".join(f"x{r.value:.2f} at batch {b}" for b, r in sorted(by_batch.items()))
        lines.append(f"* speed-up, {kind}: {shown} ({'; '.join(dict.fromkeys(r.source for r in by_batch.values()))})")
    shown = "; ".join(f"{phase}: " + ", ".join(f"{p} {v / rates.ratios[phase]['keydiff']:.2f}"
                                               for p, v in rates.ratios[phase].items() if p != "keydiff")
                      for phase in ("prefill", "decode"))
    lines.append(f"* time against KeyDiff's on the ordinary step, {shown} ({rates.ratio_source})")
    lines += [f"* from another file: {b}" for b in rates.borrowed]
    return lines


def note_lines(rates: Rates) -> list[str]:
    scales = ", ".join(f"{m} x{gb / WEIGHTS_GB[MEASURED]:.2f}" for m, gb in WEIGHTS_GB.items() if m != MEASURED)
    by_source: dict[str, list[Task]] = {}
    for task in dict.fromkeys(t for e in paper_experiments() for t in e.tasks):
        by_source.setdefault(task.source, []).append(task)
    captured = ("the fixed-shape step (captured)" if "fixed" in rates.decode
                else "the ordinary step (these rates have no fixed-shape step)")
    pooled = ("a batch's rows decode in one block ('grouped')" if "grouped" in rates.speedup else
              "a batch's rows decode each on its own ('per row': the code measured did so with separately "
              "prefilled prompts and grouped only the 5 forks of one Math-500 problem, so Math-500's batched hours "
              "are an upper bound)")
    return [
        "Extrapolated, not measured: every model is timed as the measured 3B shape scaled by its weight bytes "
        f"({scales}): decoding reads every weight once per step and prefill's FLOPs grow with the parameters. Where "
        "a step is bound by the host (kernel launches: the ordinary step spent 3.7 of its 26.7 ms per token on the "
        "GPU in the measured H200 run), its time grows with the layers, not the bytes, so the 7-8B rows are an upper "
        "bound.",
        f"KeyDiff and its variants, sink and K-norm run {captured}, and {pooled}; TOVA, SnapKV and H2O run "
        f"{captured} alone (prefill, decoding at batch 1) and the ordinary step row by row when batched, full with "
        "its own speed-up; each policy is KeyDiff's time x its ratio above (KeyDiff's variants: 1; on the fixed "
        "step the pooled ones: 1).",
        "Prefill at B = 128's rate everywhere (table10 runs B = inf, table13 B = 64 and 256, the TTFT figures "
        "B = 64-256 with flash_attention_2 or eager); samples are prefilled one at a time, batched or not.",
        "Workloads (samples per grid point, mean prompt + generated tokens): " + "; ".join(
            ", ".join(f"{t.label} {t.samples:,} x ~{t.prompt:,} + ~{t.generated:,}" for t in tasks) + f" ({source})"
            for source, tasks in by_source.items()) + ".",
    ]


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", type=Path, default=DEFAULT_RATES,
                        help=f"a rates file or a `make gpu-bench` JSON (default: {DEFAULT_RATES.relative_to(ROOT)})")
    args = parser.parse_args(argv)
    try:
        rates = load_rates(args.rates)
        lines = table_lines(rates)
    except RatesError as error:
        exit_with_error(str(error))
    title = f"GPU-hours per paper experiment on one GPU (make gpu-hours; rates: {relative(args.rates)}):"
    print("\n".join([title, "", *lines, "", *rate_lines(rates), "", *note_lines(rates)]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
