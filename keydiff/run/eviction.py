"""Whether a run's budget ever bound (summary.json's `nothing_evicted`): a run that evicted nothing scores as
the full cache would. Standard library only.
"""

from __future__ import annotations

from typing import Any


def nothing_evicted(summary: dict[str, Any]) -> bool | None:
    """True when the budget never bound (every prompt kept whole, no layer's cache above the smallest layer budget);
    False when something may have been evicted; None for the full cache or when no sample succeeded."""
    statistics = summary.get("statistics") or {}
    budgets = [b for b in statistics.get("layer_budgets") or [summary.get("budget")] if b is not None]
    full = (summary.get("config") or {}).get("policy", {}).get("name") == "full"
    if not budgets or not statistics.get("samples") or full:
        return None
    kept = statistics.get("mean_kept_ratio", statistics.get("mean_compression_ratio"))  # older summaries
    if kept != 1.0:
        return False
    held = statistics.get("max_cache_entries" if summary.get("decode_eviction", True) else "max_prompt_tokens")
    return held is not None and held <= min(budgets)


def budget_note(summary: dict[str, Any]) -> str | None:
    """One line when the budget never bound (`nothing_evicted`): e.g. `budget=8k` on the default task, whose
    prompts are at most 3,870 tokens; None otherwise."""
    if not nothing_evicted(summary):
        return None
    statistics = summary["statistics"]
    ratio = summary.get("budget_ratio")
    budget = f"budget.ratio={ratio}" if ratio is not None else f"budget.tokens={summary['budget']}"
    return (f"{budget} >= every prompt (longest {statistics['max_prompt_tokens']:,} tokens): nothing was evicted "
            "(every prompt kept whole), so this run scores as the full cache; a smaller budget or longer prompts "
            "compare policies")
