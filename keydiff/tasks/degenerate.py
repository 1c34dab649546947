"""Collapsed (degenerate) generations: an output that is mostly one token or one short n-gram repeated back to
back, flagged so a table can say how many of a run's zeros are collapses rather than wrong answers.

Design: docs/design/tasks.md#degenerate-generations
"""

from __future__ import annotations

from typing import Sequence

MIN_TOKENS = 8
MAX_N = 4
MIN_REPEATS = 3
MIN_COVERAGE = 0.5


def longest_repeat(tokens: Sequence[int], n: int) -> int:
    """Tokens covered by the longest stretch of one n-gram repeated back to back (a partial last repeat
    included), 0 when no n-gram repeats MIN_REPEATS times."""
    best, run = 0, 0  # run: tokens i with tokens[i] == tokens[i - n] in a row, ending here
    for i in range(n, len(tokens)):
        run = run + 1 if tokens[i] == tokens[i - n] else 0
        span = run + n  # the stretch: the first n-gram plus the tokens that repeat it
        if span >= MIN_REPEATS * n:
            best = max(best, span)
    return best


def is_degenerate(tokens: Sequence[int]) -> bool:
    """True when the generated `tokens` collapsed into one repeated n-gram (the definition above)."""
    tokens = list(tokens)
    if len(tokens) < MIN_TOKENS:
        return False
    covered = max(longest_repeat(tokens, n) for n in range(1, MAX_N + 1))
    return covered >= MIN_COVERAGE * len(tokens)
