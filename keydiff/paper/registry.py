"""The one declaration of the paper's tables and figures: which experiments feed each, with which policies,
models, budgets, block sizes and datasets, the table's layout kind, and how policies are named.

Read by the tables, the comparison with the paper, the figures and the W&B reports, so adding an experiment to a
table or renaming a policy is one edit here (`PaperTable`, `TOLERANCES`, `DISPLAY_NAMES`).
Design: docs/design/reports.md#paper-tables-reporttables-and-the-registry-paperregistry
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from keydiff.tasks.longbench import ALL_21, ENGLISH_16, PROMPT_LENGTH_BINS

CONF = Path(__file__).resolve().parents[2] / "conf"

# The 21 LongBench v1 datasets in the paper's column order (Tables 11-14), with the paper's headers.
LONGBENCH_HEADERS = {
    "narrativeqa": "NarrativeQA", "qasper": "Qasper", "multifieldqa_en": "MF-en", "multifieldqa_zh": "MF-zh",
    "hotpotqa": "HotpotQA", "2wikimqa": "2WikiMQA", "musique": "Musique", "dureader": "DuReader",
    "gov_report": "GovReport", "qmsum": "QMSum", "multi_news": "MultiNews", "vcsum": "VCSum",
    "trec": "TREC", "triviaqa": "TriviaQA", "samsum": "SAMSum", "lsht": "LSHT", "passage_count": "PCount",
    "passage_retrieval_en": "PR-en", "passage_retrieval_zh": "PR-zh", "lcc": "Lcc", "repobench-p": "RB-P",
}
LONGBENCH = {dataset: LONGBENCH_HEADERS[dataset] for dataset in ALL_21}  # keydiff.tasks.longbench's order
SUITE = list(LONGBENCH)
ENGLISH = [d for d in SUITE if d in ENGLISH_16]  # Table 1's columns (English and code)

# How a policy label is printed in every table, comparison and figure (the analysis figures included).
DISPLAY_NAMES = {"full": "Full", "h2o": "H2O", "tova": "TOVA", "sink": "Sink", "snapkv": "SnapKV", "keydiff": "KeyDiff",
                 "knorm": "L2-norm", "keydiff_w10": "KeyDiff + 10%", "keydiff_w20": "KeyDiff + 20%",
                 "keydiff_pairwise": "Pairwise", "keydiff_median": "Median", "keydiff_dot": "DotProd",
                 "keydiff_euclidean": "Euclidean", "chunkkv": "ChunkKV",
                 "criticalkv": "CriticalKV", "kvzip": "KVzip", "lagkv": "LagKV", "random": "Random",
                 "expected_attention": "ExpectedAttention", "snapkv_pyramid": "PyramidKV",
                 "adakv_keydiff": "AdaKV-KeyDiff", "adakv_snapkv": "AdaKV-SnapKV",
                 "adakv_expected_attention": "AdaKV-ExpectedAttention", "adakv_criticalkv": "AdaKV-CriticalKV"}


def display_name(label: str) -> str:
    """The printed name of a policy label ("knorm" -> "L2-norm"); a label without one is printed as is. A
    leaderboard row's " (query-aware)" mark stays after the method's name."""
    base, mark, _ = label.partition(" (query-aware)")
    return DISPLAY_NAMES.get(base, base) + mark if mark else DISPLAY_NAMES.get(label, label)


@lru_cache(maxsize=1)
def policy_configs() -> dict[str, str]:
    """Policy label (what runs record, keydiff_w20) -> its config file under conf/policy (keydiff_window20),
    read from the files' `label` fields; labels computed by an interpolation (custom) are left out."""
    configs = {}
    for path in sorted(CONF.glob("policy/*.yaml")):
        match = re.search(r"^label:\s*(\S+)\s*$", path.read_text(encoding="utf-8"), re.MULTILINE)
        if match and "${" not in match[1]:
            configs.setdefault(match[1], path.stem)
    return configs


def config_name(label: str) -> str:
    """The `policy=` value that runs the policy recorded as `label` (the label itself when no file says)."""
    return policy_configs().get(label, label)


LLAMAS = ["llama-3.1-8b-instruct", "llama-3.2-3b-instruct"]
QWENS = ["qwen2.5-7b-instruct", "qwen2.5-3b-instruct"]
LLAMA_R1, QWEN_R1 = "deepseek-r1-distill-llama-8b", "deepseek-r1-distill-qwen-7b"
LLAMA_3B = "llama-3.2-3b-instruct"
BASELINES = ["h2o", "tova", "sink", "snapkv", "keydiff"]
BUDGETS = ["1k", "2k", "4k", "6k", "8k"]
LONGBENCH_TASKS = ("longbench_full", "longbench")  # not longbench_e: other samples
GEN_LENGTH = {"math500": "4K", "math500_8k": "8K", "math500_32k": "32K"}  # Math-500 task -> generation length
MATH = ("table4_gen4k", "table4_gen8k", "table4_gen32k", "table4_full")


def baseline_experiment(experiment: str) -> str:
    """The experiment whose full-cache run is the baseline of `experiment`'s runs (Tables 5/7): table4_full for the
    Math-500 experiments, else itself."""
    return MATH[-1] if experiment in MATH else experiment
MATH_POLICIES = ["full", "keydiff_w20", "snapkv"]
# every method x kept ratio (query-agnostic), the query-aware loop, then the full cache once
LEADERBOARD = ("leaderboard", "leaderboard_query_aware", "leaderboard_full")
# the protocol comparison (keydiff.report.protocol): independent questions under both protocols, the shared-context
# modes at k = 2, 4, 8, and the full cache for each
PROTOCOL = ("protocol", "protocol_shared", "protocol_full", "protocol_shared_full")
PAPER_KEYDIFF = {"keydiff_w20": "keydiff"}  # App. E: the paper's "KeyDiff" of Tables 4-7
SUBSET = "Math-500 on the samples whose full-cache context exceeds the budget"


@dataclass(frozen=True)
class PaperTable:
    name: str
    paper: int | None                 # the paper's table number (None: ours only, the smoke table)
    kind: str                         # the layout (a builder of keydiff.report.tables per kind)
    caption: str
    reads: tuple[str, ...]
    run: tuple[str, ...]
    fill: tuple[str, str] | None = None
    tasks: tuple[str, ...] | None = None
    models: list[str] | None = None
    policies: list[str] | None = None
    budgets: list[str] | None = None
    block_sizes: tuple[str, ...] = ("128",)
    datasets: list[str] = field(default_factory=list)
    needs: list[str] | None = None
    paper_labels: dict[str, str] = field(default_factory=dict)

    @property
    def model(self) -> str | None:
        """The one model of a single-model table (Tables 4-7, 17, 18)."""
        return self.models[0] if self.models and len(self.models) == 1 else None


def _longbench(name, paper, caption, reads, run, fill, models, policies, datasets, block_sizes=("128",),
               tasks=LONGBENCH_TASKS, **extra) -> PaperTable:
    return PaperTable(name, paper, "longbench", caption, tuple(reads), tuple(run), fill, tasks, models, policies,
                      BUDGETS, block_sizes, datasets, **extra)


def _math(name, paper, kind, model, caption) -> PaperTable:
    policies = MATH_POLICIES if kind == "math500" else MATH_POLICIES[1:]
    return PaperTable(name, paper, kind, caption, MATH, MATH, ("table4_gen", "table4_full"), tuple(GEN_LENGTH),
                      [model], policies, block_sizes=(), paper_labels=PAPER_KEYDIFF)


TABLES: dict[str, PaperTable] = {t.name: t for t in [
    _longbench("table1", 1, "LongBench English subset, B = 128.", ["table1", "table11", "table1_full", "table11_full"],
               ["table1", "table1_full"], ("table1", "table1_full"), LLAMAS, BASELINES, ENGLISH,
               tasks=("longbench", "longbench_full")),
    _math("table4", 4, "math500", LLAMA_R1, "Math-500, DeepSeek-R1-Distill-Llama-8B."),
    _math("table5", 5, "math500_subsets", LLAMA_R1, f"{SUBSET}, DeepSeek-R1-Distill-Llama-8B."),
    _math("table6", 6, "math500", QWEN_R1, "Math-500, DeepSeek-R1-Distill-Qwen-7B."),
    _math("table7", 7, "math500_subsets", QWEN_R1, f"{SUBSET}, DeepSeek-R1-Distill-Qwen-7B."),
    PaperTable("table8", 8, "prompt_lengths", "LongBench prompt lengths in tokens", ("table11_full", "table11",
               "table1_full", "table1"), ("table11_full",), ("table11_full", "table11_full"), LONGBENCH_TASKS, LLAMAS,
               block_sizes=()),
    PaperTable("table9", 9, "compression", "Average compression ratio min(N / L, 1) per budget",
               ("table11", "table1", "table12", "table13", "table14"), ("table11",), ("table11", "table11"),
               LONGBENCH_TASKS, LLAMAS, budgets=BUDGETS[1:]),
    _longbench("table10", 10, "LongBench with B = inf (no NarrativeQA).", ["table10", "table11_full", "table1_full"],
               ["table10", "table11_full"], ("table10", "table11_full"), LLAMAS, BASELINES, SUITE[1:], ("inf",)),
    _longbench("table11", 11, "Full LongBench suite, B = 128.", ["table11", "table11_full"], ["table11", "table11_full"],
               ("table11", "table11_full"), LLAMAS, BASELINES + ["knorm"], SUITE),
    _longbench("table12", 12, "Full LongBench suite, Qwen-2.5, B = 128.", ["table12", "table12_full"],
               ["table12", "table12_full"], ("table12", "table12_full"), QWENS, BASELINES, SUITE),
    _longbench("table13", 13, "Llama-3.2-3B-Instruct, block sizes B = 64 and 256.", ["table13", "table11_full"],
               ["table13", "table11_full"], ("table13", "table11_full"), [LLAMA_3B], BASELINES, SUITE, ("64", "256")),
    _longbench("table14", 14, "KeyDiff + recent tokens, B = 128.", ["table14", "table11", "table11_full"],
               ["table14", "table11", "table11_full"], ("table14", "table11_full"), LLAMAS,
               ["sink", "snapkv", "keydiff_w10", "keydiff_w20", "keydiff"], SUITE, needs=["keydiff_w10", "keydiff_w20"]),
    PaperTable("table15", 15, "ablation", "Anchor ablation: full LongBench average, Llama-3.2-3B-Instruct.",
               ("table15", "table11"), ("table15",), ("table15", "table15"), LONGBENCH_TASKS, [LLAMA_3B],
               ["keydiff", "keydiff_pairwise", "keydiff_median"], BUDGETS, datasets=SUITE),
    PaperTable("table16", 16, "ablation", "Similarity ablation: full LongBench average, Llama-3.2-3B-Instruct.",
               ("table16", "table11"), ("table16",), ("table16", "table16"), LONGBENCH_TASKS, [LLAMA_3B],
               ["keydiff", "keydiff_dot", "keydiff_euclidean"], BUDGETS, datasets=SUITE),
    PaperTable("table17", 17, "phonebook",
               "Phonebook lookup accuracy by book size, Llama-3.2-3B-Instruct, 6K budget, B = 128.",
               ("table17",), ("table17",), ("table17", "table17"), ("phonebook",), [LLAMA_3B], ["full", "keydiff", "tova"],
               ["6k"]),
    PaperTable("table18", 18, "niah_difference",
               "Needle recall difference (KeyDiff - Full), Llama-3.2-3B-Instruct, 6K, B = 128.",
               ("fig6_niah",), ("fig6_niah",), ("fig6_niah", "fig6_niah"), ("niah",), [LLAMA_3B], ["full", "keydiff"],
               ["6k"]),
    PaperTable("smoke", None, "smoke", "Smoke sweep", ("smoke",), ("smoke",), block_sizes=()),
    PaperTable("leaderboard", None, "leaderboard", "kvpress-style leaderboard: average RULER score per method and "
               "fraction of the prompt kept.", LEADERBOARD, LEADERBOARD, block_sizes=()),
    PaperTable("protocol", None, "protocol", "Protocol comparison: several questions over one compressed context "
               "(shared_ruler_4k, RULER 4K haystacks with k needles, one question per needle).", PROTOCOL, PROTOCOL,
               block_sizes=()),
]}


@dataclass(frozen=True)
class PaperFigure:
    title: str
    prefix: str                # the figure files' name prefix in results/figures
    run: tuple[str, ...]       # the experiments that feed it


FIGURES = [
    PaperFigure("Figures 6 / 19: NIAH heatmaps", "niah", ("fig6_niah",)),
    PaperFigure("Figures 7 / 17: TTFT vs budget", "ttft_", ("fig7_ttft", "fig17_ttft_eager")),
    PaperFigure("Figure 18: LongBench prompt lengths", "prompt_lengths_", ("table11_full",)),
    PaperFigure("Leaderboard (kvpress-style): average RULER score vs fraction kept", "leaderboard", LEADERBOARD),
    PaperFigure("Protocol comparison: score per way of asking about a compressed context", "protocol", PROTOCOL),
]

# |ours - paper| above these is "outside" (docs/design/reports.md#against-the-paper-reportagainst_paper says why each).
TOLERANCES = {"score": 2.0, "longbench_avg": 1.0, "flex": 0.03, "exact": 0.03, "compression_ratio": 0.03,
              "accuracy": 0.2, "recall_difference": 0.1, "spearman_rho": 0.05}
RELATIVE_TOLERANCES = {"avg_gen_length": 0.10, "relative_latency": 0.5}  # fractions of the paper's value
PROMPT_BINS = [name for name, _ in PROMPT_LENGTH_BINS]  # <=2K ... >8K: what the LongBench task counts per dataset
COUNTS = ("<=2K", "2K-4K", "4K-6K", "6K-8K", ">=8K", "total")  # Table 8's prompt-count columns, as the paper names them
COUNT_TOLERANCE = 10.0

# Paper tables that hold the numbers of an experiment named after another one: the table4_* experiments
# (Math-500) run both R1 distills, whose whole-set results are Table 4 (Llama) and Table 6 (Qwen).
SHARED_TABLES = {"4": ("4", "6")}


def table_numbers(experiment_name: str) -> tuple[str, ...]:
    """The paper tables an experiment's runs are logged against (W&B `paper/` keys and reports):
    table1 / table1_full / table4_gen8k -> ("1",) / ("1",) / ("4", "6"); figures and ad-hoc runs -> ()."""
    match = re.match(r"table(\d+)", str(experiment_name))
    return SHARED_TABLES.get(match.group(1), (match.group(1),)) if match else ()
