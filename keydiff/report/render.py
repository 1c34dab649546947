"""How every table, comparison and figure shows a number: intervals, formats, marks, budget order, md/tex.

One module so that each is defined once. The definitions: docs/experiments.md, "Uncertainty".
Design: docs/design/reports.md#intervals-formats-and-marks-reportrender
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
import pandas as pd

Z95 = 1.959963984540054  # two-sided 95 % normal quantile
NA = "--"  # a missing number, and the budget of the full cache (no eviction)


def standard_error(values: Sequence[float]) -> float:
    """SE of the mean of `values`; NaN for fewer than two values."""
    n = len(values)
    if n < 2:
        return math.nan
    mean = sum(values) / n
    variance = sum((v - mean) ** 2 for v in values) / (n - 1)
    return math.sqrt(variance / n)


def combined_se(ses: Iterable[float]) -> float:
    """SE of the unweighted mean of independent estimates with these SEs; NaN when any is NaN or none."""
    ses = [float(s) for s in ses]
    if not ses or any(math.isnan(s) for s in ses):
        return math.nan
    return math.sqrt(sum(s * s for s in ses)) / len(ses)


def seeds_se(ses: Iterable[float]) -> float:
    """SE bound for the mean over seeds of one configuration (repeated measures of the same samples): the
    mean of the seeds' SEs, since SE(mean of k correlated estimates) <= mean of their SEs; NaN when any is
    NaN or none."""
    ses = [float(s) for s in ses]
    if not ses or any(math.isnan(s) for s in ses):
        return math.nan
    return sum(ses) / len(ses)


def grouped_mean_se(groups: Sequence[Sequence[float]], scale: float = 1.0) -> tuple[float, float]:
    """(mean of the group means, its SE), both times `scale`: the SE behind an average over datasets."""
    groups = [g for g in groups if len(g)]
    if not groups:
        return math.nan, math.nan
    mean = sum(sum(g) / len(g) for g in groups) / len(groups)
    return scale * mean, scale * combined_se(standard_error(g) for g in groups)


def half_width(se: float) -> float:
    """Half-width of the 95 % interval."""
    return Z95 * se


MIN_INTERVAL_N = 5  # fewer samples: no interval is shown ("n too small")
TOO_FEW = "n too small"
CONSTANT = "constant"  # a measure that is the same for every sample: no interval
# Relative to a metric's range (unbounded: to max(1, |mean|)): below this a difference is float rounding, not data.
TOLERANCE = 1e-6
UNBOUNDED = re.compile(r"ttft|_s$|tokens|length$|(^|/)n$|count|bytes|entries")  # times, lengths, counts
PERCENT_FAMILIES = ("longbench", "ruler")  # their scores are 0-100 (round(100 * mean, 2), as the official scorers)


def metric_range(column: str, task: str = "") -> tuple[float, float] | None:
    """The range a metric's per-sample values live in: (0, 100) for LongBench's and RULER's scores, (0, 1) for
    every other score and for kept N/L; None for times, lengths and counts (no bound above)."""
    if UNBOUNDED.search(column):
        return None
    percent = str(task).startswith(PERCENT_FAMILIES) and (
        column in ("score", "metrics/average") or column.startswith(("lb/", "metrics/datasets/", "metrics/tasks/")))
    return (0.0, 100.0) if percent else (0.0, 1.0)


def missing(value) -> bool:
    """None, NaN or NA: a cell with no number (a string, even "", is text, not missing)."""
    return value is None or (not isinstance(value, str) and bool(pd.isna(value)))


def wilson(p: float, n: float) -> tuple[float, float]:
    """Wilson score 95 % interval of a proportion p observed over n trials; inside [0, 1]."""
    z2 = Z95 * Z95
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = Z95 / (1 + z2 / n) * math.sqrt(max(p * (1 - p), 0.0) / n + z2 / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)


def scale_of(mean: float, bounds: tuple[float, float] | None) -> float:
    """What TOLERANCE is relative to: the metric's range, else the size of the mean (at least 1)."""
    return bounds[1] - bounds[0] if bounds is not None else max(1.0, abs(mean))


def snapped(mean: float, se: float, bounds: tuple[float, float] | None) -> tuple[float, float]:
    """(mean, se) with a mean within TOLERANCE of a bound moved onto it and an SE within TOLERANCE of 0 made 0."""
    tolerance = TOLERANCE * scale_of(mean, bounds)
    if bounds is not None:
        mean = next((bound for bound in bounds if abs(mean - bound) <= tolerance), mean)
    if not missing(se) and abs(float(se)) <= tolerance:
        se = 0.0
    return mean, se


def is_constant(mean: float, se: float, bounds: tuple[float, float] | None = None) -> bool:
    """Every sample had the same value (an SE of 0, within TOLERANCE); False when the SE is unknown."""
    se = snapped(mean, se, bounds)[1]
    return not missing(se) and float(se) == 0.0


def interval(mean: float, se: float, n=None, bounds: tuple[float, float] | None = None,
             measure: bool = False) -> tuple[float, float] | None:
    """The 95 % interval of a mean (docs/experiments.md, "Uncertainty"): Wilson inside `bounds`, else
    mean +- 1.96 SE; None when there is none (n < MIN_INTERVAL_N, no SE for an unbounded metric, or a constant
    `measure`)."""
    if not missing(n) and float(n) < MIN_INTERVAL_N:
        return None
    mean, se = snapped(mean, se, bounds)
    if measure and is_constant(mean, se, bounds):
        return None
    if bounds is not None and not missing(n) and bounds[0] <= mean <= bounds[1]:
        low, high = bounds
        p = (mean - low) / (high - low)
        spread = math.nan if missing(se) else float(se) / (high - low)
        effective = p * (1 - p) / spread ** 2 if spread > 0 and 0 < p < 1 else float(n)
        lo, hi = wilson(p, effective)
        return low + (high - low) * lo, low + (high - low) * hi
    if missing(se):
        return None
    return mean - Z95 * float(se), mean + Z95 * float(se)


SAME = object()  # format_estimate's shown_n default: print the n the interval uses


def format_estimate(mean: float, se: float, n: int | float | None = None, precision: int = 3,
                    bounds: tuple[float, float] | None = None, shown_n=SAME, measure: bool = False) -> str:
    """The value, its 95 % interval and the samples behind it: "0.864 [0.509, 0.972] (n=6)" for a bounded
    score, "9.874 ± 1.829 (n=6)" for a time, "1.000 [n too small] (n=2)" below 5 samples ("± n/a": no SE),
    "1.000 [constant] (n=6)" for a `measure` the same for every sample. `shown_n`: the n printed when it is not
    the interval's (samples per task beside an average over tasks; None: none printed)."""
    if mean is None or (isinstance(mean, float) and math.isnan(mean)):
        return NA
    shown = n if shown_n is SAME else shown_n
    count = "" if missing(shown) else f" (n={int(shown)})"
    if not missing(n) and float(n) < MIN_INTERVAL_N:
        return f"{mean:.{precision}f} [{TOO_FEW}]{count}"
    mean, se = snapped(float(mean), se, bounds)
    if measure and is_constant(mean, se, bounds):
        return f"{mean:.{precision}f} [{CONSTANT}]{count}"
    if bounds is not None and not missing(n) and bounds[0] <= mean <= bounds[1]:
        lo, hi = interval(mean, se, n, bounds)
        return f"{mean:.{precision}f} [{lo:.{precision}f}, {hi:.{precision}f}]{count}"
    spread = "n/a" if missing(se) else f"{half_width(float(se)):.{precision}f}"
    return f"{mean:.{precision}f} ± {spread}{count}"


def number(value, precision: int = 2) -> str:
    """A table cell: floats with `precision` decimals, anything else (counts, text) as it is, NA if missing."""
    if missing(value):
        return NA
    return f"{value:.{precision}f}" if isinstance(value, (float, np.floating)) else str(value)


def decimals(value, precision: int = 3) -> str:
    """A measurement with a fixed number of decimals, whatever its type (5 -> "5.000"); NA if missing."""
    return NA if missing(value) else f"{value:.{precision}f}"


def trimmed(value, digits: int = 3) -> str:
    """Up to `digits` decimals, trailing zeros dropped (10 stays 10, 0.500 becomes 0.5); NA if missing."""
    if missing(value):
        return NA
    text = f"{value:.{digits}f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def plural(n, noun: str, many: str | None = None) -> str:
    """"1 configuration", "2 configurations", "1 policy": a count with its noun in the right number
    (`many`: an irregular plural; default noun + "s", or "ies" for a consonant + "y")."""
    n = int(n)
    if n == 1:
        return f"1 {noun}"
    if many is None:
        many = noun[:-1] + "ies" if noun.endswith("y") and noun[-2:-1] not in "aeiou" else noun + "s"
    return f"{n} {many}"


def count(value) -> str:
    """A count as a whole number; NA if missing."""
    return NA if missing(value) else str(int(round(value)))


SUBSET, FAILED, INCOMPLETE = "§", "†", "~"  # task.limit set; k samples failed (†k); run not complete
NOTHING_EVICTED = "∅"  # the budget held every prompt and the cache never outgrew it: the run is the full cache
MARKS_LEGEND = "§ subset run (task.limit), †k k samples failed, ~ run not complete"


def marks(subset, failed, incomplete, nothing_evicted=False) -> str:
    """"§†2~∅": the marks of a cell's run(s); `failed` is a sample count (0 or NaN: none)."""
    out = SUBSET if subset else ""
    out += f"{FAILED}{int(failed)}" if not missing(failed) and failed else ""
    return out + (INCOMPLETE if incomplete else "") + (NOTHING_EVICTED if nothing_evicted else "")


RATIO_KEY = 1e9  # ratio labels sort after every token budget: RATIO_KEY x (1 + ratio)


def budget_ratio(label) -> float | None:
    """The ratio of a ratio budget's label ("r0.25" -> 0.25; keydiff.config.ratio_label), else None."""
    match = re.fullmatch(r"r(\d+(?:\.\d+)?(?:e-?\d+)?)", str(label))
    return float(match[1]) if match else None


def budget_tokens(label) -> float:
    """Sort key of a budget label: NA (the full cache) first, then by tokens (2k = 2048), then ratio budgets
    by ratio ("r0.25"), unknown labels ("unbounded") last."""
    if label == NA:
        return -1.0
    ratio = budget_ratio(label)
    if ratio is not None:
        return RATIO_KEY * (1 + ratio)
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([km]?)", str(label).lower())
    return float(match[1]) * {"": 1, "k": 1024, "m": 1024 ** 2}[match[2]] if match else float("inf")


TEX_SPECIAL = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_",
               "{": r"\{", "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}"}
INTERVAL_NOTE = ("Cells: value [95 % confidence interval] over samples (Wilson score interval inside the score's "
                 "range; \"± half-width\" (1.96 standard errors) for unbounded numbers; no interval below 5 samples: "
                 "\"n too small\", nor for a measure such as kept N/L that is the same for every sample: \"constant\"; "
                 "docs/experiments.md, \"Uncertainty\"), n = samples.")


def tex_escape(text: str) -> str:
    """Plain text (captions) for LaTeX; table cells are escaped by pandas' Styler."""
    return "".join(TEX_SPECIAL.get(ch, ch) for ch in str(text))


def markdown_rows(frame: pd.DataFrame) -> list[str]:
    """A flat frame as Markdown table lines (header, rule, one line per row), cells as str()."""
    lines = ["| " + " | ".join(map(str, frame.columns)) + " |", "|" + "---|" * len(frame.columns)]
    return lines + ["| " + " | ".join(str(v) for v in row) + " |" for row in frame.itertuples(index=False)]


def best_mask(table: pd.DataFrame, groups: list[str] | None, columns, exclude_full=True) -> pd.DataFrame:
    """True where a cell holds its group's maximum and that is above the rest: ties at the top are all bold; a group
    whose cells all tie, or of one cell, bolds none. Values within TOLERANCE (relative to max(1, |best|)) tie; the
    eviction-free rows ("Full" / "Dense") are never bold."""
    mask = pd.DataFrame(False, index=table.index, columns=table.columns)
    frame = table.reset_index()
    eligible = ~frame["Method"].isin(["Full", "Dense"]) if exclude_full and "Method" in frame else frame.index >= 0
    keys = [frame[g] for g in groups] if groups else [pd.Series(0, index=frame.index)]
    for column in columns:
        values = pd.to_numeric(frame[column].where(eligible), errors="coerce")
        best, worst = values.groupby(keys).transform("max"), values.groupby(keys).transform("min")
        tolerance = TOLERANCE * np.maximum(1.0, best.abs())
        mask[column] = ((best - values <= tolerance) & (best - worst > tolerance) & values.notna()).to_numpy()
    return mask


def with_intervals(table: pd.DataFrame, se: pd.DataFrame, n: pd.DataFrame, precision: int,
                   bounds: tuple[float, float] | None = None, measure: bool = False) -> pd.DataFrame:
    """The cells as text "value [low, high] (n=...)" (format_estimate; `bounds`: the range of every cell's
    metric, None if unbounded; `measure`: the cells are measures, not scores); `se` and `n` have the table's
    shape (NaN where unknown)."""
    text = table.astype(object).copy()
    for i in range(table.shape[0]):
        for j in range(table.shape[1]):
            value = table.iat[i, j]
            text.iat[i, j] = NA if pd.isna(value) else format_estimate(float(value), float(se.iat[i, j]), n.iat[i, j],
                                                                        precision, bounds, measure=measure)
    return text


def write_table(table: pd.DataFrame, mask: pd.DataFrame | None, out: Path, name: str, caption: str, precision=2,
                se: pd.DataFrame | None = None, n: pd.DataFrame | None = None, bounds: tuple[float, float] | None = None,
                measure: bool = False):
    """`name`.tex (booktabs, \\textbf on the mask) and `name`.md (**bold**), same numbers in both. With `se`
    (and `n`), every cell shows its 95 % interval (inside `bounds`, the metric's range; none for a `measure` that
    is constant) and sample count."""
    mask = mask if mask is not None else pd.DataFrame(False, index=table.index, columns=table.columns)
    if se is not None:
        n = n if n is not None else pd.DataFrame(np.nan, index=table.index, columns=table.columns)
        table = with_intervals(table, se, n, precision, bounds, measure)
        caption = f"{caption} {INTERVAL_NOTE}"
    css = pd.DataFrame(np.where(mask, "textbf:--rwrap;", ""), index=table.index, columns=table.columns)
    styler = table.style.format(precision=precision, na_rep=NA, escape="latex").format_index(escape="latex", axis=0)
    styler = styler.format_index(escape="latex", axis=1).apply(lambda _: css, axis=None)
    tex = styler.to_latex(hrules=True, caption=caption, label=f"tab:{name}", position_float="centering",
                          multirow_align="t").replace("±", r"$\pm$")
    (out / f"{name}.tex").write_text(tex, encoding="utf-8")
    flat, flat_mask = table.reset_index(), mask.reset_index(drop=True)
    lines = [f"**{name}**: {caption}", "", "| " + " | ".join(map(str, flat.columns)) + " |",
             "|" + "---|" * len(flat.columns)]
    for i, row in flat.iterrows():
        cells = [number(row[c], precision) for c in flat.columns]
        cells = [f"**{v}**" if c in flat_mask and flat_mask.at[i, c] else v for c, v in zip(flat.columns, cells)]
        lines.append("| " + " | ".join(cells) + " |")
    (out / f"{name}.md").write_text("\n".join(lines) + "\n", encoding="utf-8")


def latex(table: pd.DataFrame, caption: str, label: str) -> str:
    """A table of text cells as booktabs LaTeX (cells and index escaped, caption via tex_escape)."""
    return table.style.format(escape="latex").format_index(escape="latex", axis=0).format_index(
        escape="latex", axis=1).to_latex(hrules=True, caption=tex_escape(caption), label=label, position_float="centering")
