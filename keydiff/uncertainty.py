"""The one uncertainty the tables and figures show: a 95 % confidence interval from the standard error.

Why the standard error and not a bootstrap: tables and figures read only results/summary.csv, and a cell
often combines estimates (LongBench's average is the mean of 21 dataset scores, a configuration run with
several seeds is the mean of their scores). Standard errors of independent estimates combine exactly
(`combined_se`), so each run stores one number per score and every table and figure derives its interval
from it the same way; a bootstrap would need the per-sample scores at table time.

Definitions (documented once, in the README's "Results" paragraph):
  SE of a plain mean         sample standard deviation (n - 1) / sqrt(n), per-sample scores
  SE of a mean of groups     sqrt(sum of the groups' SE^2) / G (LongBench's and RULER's average over
                             datasets / tasks, each group weighted equally as their averages do)
  SE of a mean over seeds    the same rule over the seeds' SEs
  95 % interval              mean +- 1.96 SE (normal approximation); shown as "value ± half-width"
A single sample has no SE (NaN, shown "± n/a"); all samples equal give SE 0: n is always printed beside
the interval, because with n = 2 an interval of 0 says little.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

Z95 = 1.959963984540054  # two-sided 95 % normal quantile


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
        return "--"
    spread = "n/a" if se is None or math.isnan(float(se)) else f"{half_width(float(se)):.{precision}f}"
    count = "" if n is None or (isinstance(n, float) and math.isnan(n)) else f" (n={int(n)})"
    return f"{mean:.{precision}f} ± {spread}{count}"
