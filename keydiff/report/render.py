"""How every table, comparison and figure shows a number: intervals, formats, marks, budget order, md/tex.

One module so that each of these is defined once: the 95 % interval from a standard error, the way a
number is printed ("--" when missing), the marks of a subset / failed / unfinished run, the order of
budget labels, LaTeX escaping, and the writing of a table as Markdown and booktabs LaTeX.

Why the standard error and not a bootstrap: tables and figures read only results/summary.csv, and a cell
often combines estimates (LongBench's average is the mean of 21 dataset scores, a configuration run with
several seeds is the mean of their scores). Standard errors of independent estimates combine exactly
(`combined_se`), those of repeated measures of the same samples are bounded (`seeds_se`), so each run
stores one number per score and every table and figure derives its interval from it the same way; a
bootstrap would need the per-sample scores at table time.

Definitions (documented once, in docs/experiments.md, "Uncertainty"):
  SE of a plain mean         the sample standard deviation (with n - 1) divided by sqrt(n), per-sample scores
  SE of a mean of groups     sqrt(sum of the groups' SE^2) / G (LongBench's and RULER's average over
                             datasets / tasks, each group weighted equally as their averages do)
  SE of a mean over seeds    the mean of the seeds' SEs, n the per-seed n: the run seed only seeds sampling
                             (task data is fixed by task.seed, most tasks decode greedily), so the seeds
                             score the same samples, and the SE of an average of correlated estimates is
                             at most the mean of their SEs (a conservative bound, not sqrt(k) narrower)
  95 % interval              mean +- 1.96 SE (normal approximation); shown as "value ± half-width"
A single sample has no SE (NaN, shown "± n/a"); all samples equal give SE 0: n is always printed beside
the interval, because with n = 2 an interval of 0 says little.
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


def interval(mean: float, se: float) -> tuple[float, float]:
    return mean - Z95 * se, mean + Z95 * se


def format_estimate(mean: float, se: float, n: int | float | None = None, precision: int = 3) -> str:
    """"0.864 ± 0.094 (n=6)": the value, the 95 % half-width ("n/a" without an SE) and the samples behind it."""
    if mean is None or (isinstance(mean, float) and math.isnan(mean)):
        return NA
    spread = "n/a" if se is None or math.isnan(float(se)) else f"{half_width(float(se)):.{precision}f}"
    count = "" if n is None or (isinstance(n, float) and math.isnan(n)) else f" (n={int(n)})"
    return f"{mean:.{precision}f} ± {spread}{count}"


# ----------------------------------------------------------------------------- numbers
def missing(value) -> bool:
    return value is None or (not isinstance(value, str) and bool(pd.isna(value)))


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


# ----------------------------------------------------------------------------- marks and order
SUBSET, FAILED, INCOMPLETE = "§", "†", "~"  # task.limit set; k samples failed (†k); run not complete
MARKS_LEGEND = "§ subset run (task.limit), †k k samples failed, ~ run not complete"


def marks(subset, failed, incomplete) -> str:
    """"§†2~": the marks of a cell's run(s); `failed` is a sample count (0 or NaN: none)."""
    out = SUBSET if subset else ""
    out += f"{FAILED}{int(failed)}" if not missing(failed) and failed else ""
    return out + (INCOMPLETE if incomplete else "")


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


# ----------------------------------------------------------------------------- Markdown and LaTeX
TEX_SPECIAL = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_",
               "{": r"\{", "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}"}
INTERVAL_NOTE = ("Cells: value ± half-width of the 95 % confidence interval over samples (1.96 standard errors; "
                 "averages over datasets combine the datasets' errors; docs/experiments.md, \"Uncertainty\"), n = samples.")


def tex_escape(text: str) -> str:
    """Plain text (captions) for LaTeX; table cells are escaped by pandas' Styler."""
    return "".join(TEX_SPECIAL.get(ch, ch) for ch in str(text))


def markdown_rows(frame: pd.DataFrame) -> list[str]:
    """A flat frame as Markdown table lines (header, rule, one line per row), cells as str()."""
    lines = ["| " + " | ".join(map(str, frame.columns)) + " |", "|" + "---|" * len(frame.columns)]
    return lines + ["| " + " | ".join(str(v) for v in row) + " |" for row in frame.itertuples(index=False)]


def best_mask(table: pd.DataFrame, groups: list[str] | None, columns, exclude_full=True) -> pd.DataFrame:
    """True where a cell holds the maximum of its column within its group of rows (ties all bold); the
    eviction-free rows (Method "Full" / "Dense") are references, never bold."""
    mask = pd.DataFrame(False, index=table.index, columns=table.columns)
    frame = table.reset_index()
    eligible = ~frame["Method"].isin(["Full", "Dense"]) if exclude_full and "Method" in frame else frame.index >= 0
    keys = [frame[g] for g in groups] if groups else [pd.Series(0, index=frame.index)]
    for column in columns:
        values = frame[column].where(eligible)
        best = values.groupby(keys).transform("max")
        mask[column] = ((values == best) & values.notna()).to_numpy()
    return mask


def with_intervals(table: pd.DataFrame, se: pd.DataFrame, n: pd.DataFrame, precision: int) -> pd.DataFrame:
    """The cells as text "value ± half-width (n=...)" (format_estimate); `se` and `n` have the table's
    shape (NaN where unknown)."""
    text = table.astype(object).copy()
    for i in range(table.shape[0]):
        for j in range(table.shape[1]):
            value = table.iat[i, j]
            text.iat[i, j] = NA if pd.isna(value) else format_estimate(float(value), float(se.iat[i, j]), n.iat[i, j], precision)
    return text


def write_table(table: pd.DataFrame, mask: pd.DataFrame | None, out: Path, name: str, caption: str, precision=2,
                se: pd.DataFrame | None = None, n: pd.DataFrame | None = None):
    """`name`.tex (booktabs, \\textbf on the mask) and `name`.md (**bold**), same numbers in both. With `se`
    (and `n`), every cell shows its 95 % interval and sample count."""
    mask = mask if mask is not None else pd.DataFrame(False, index=table.index, columns=table.columns)
    if se is not None:
        n = n if n is not None else pd.DataFrame(np.nan, index=table.index, columns=table.columns)
        table = with_intervals(table, se, n, precision)
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
