"""The contract every policy preset (and compositions no preset reaches) keeps on every path (ordinary, fixed-shape
step, a group of three): each eviction is the brute-force choice by loops, the N_l + B bound holds, every path equals
the ordinary one, N >= L is `full`, and the goldens hold. Each scorer's own formula is in its policy's test file."""

from __future__ import annotations

import math

import pytest
import torch

from keydiff import build_policy, generate, generate_batch, prefill
from keydiff.decode import Request
from keydiff.policies import Chunked, Critical, HeadAdaptive, LayerBudgets, LayerView, RecentWindow
from keydiff.policies.adakv import relative_scores
from keydiff.policies.base import chooses_whole_segments
from keydiff.policies.criticalkv import STATE
from keydiff.testing import variant
from tests.conftest import CORE_POLICIES, extended_unless
from tests.test_golden import policy_presets, preset, recorded as goldens

pytestmark = pytest.mark.integration

BUDGET, BLOCK, NEW = 64, 16, 5
LENGTHS = (150, 97, 40)  # the last one below N: never evicted
EXTRA = {  # compositions no preset reaches: (policy, parameters)
    "criticalkv_keydiff_window": ("keydiff", {"critical": True, "window_fraction": 0.2}),  # negative scores, a window
    "criticalkv_snapkv_epsilon": ("snapkv", {"window": 8, "critical": True, "critical_epsilon": 0.05}),  # x rows
    "criticalkv_keydiff_pyramid": ("keydiff", {"critical": True, "layer_budgets": {"schedule": "pyramid", "beta": 4}}),
    "chunkkv_keydiff_window_pyramid": ("keydiff", {"window_fraction": 0.2, "chunk_length": 5,
                                                  "layer_budgets": {"schedule": "pyramid", "beta": 4}}),
    "criticalkv_expected_attention": ("expected_attention", {"critical": True, "use_vnorm": False}),  # log scores
    "adakv_criticalkv_keydiff": ("keydiff", {"critical": True, "head_budgets": "adakv"}),
    "adakv_criticalkv_alpha": ("snapkv", {"window": 8, "critical": True, "head_budgets": "adakv",
                                          "alpha_safeguard": 0.6}),
    "adakv_snapkv_pyramid": ("snapkv", {"window": 8, "head_budgets": "adakv",
                                        "layer_budgets": {"schedule": "pyramid", "beta": 4}}),
    "adakv_keydiff_window": ("keydiff", {"window_fraction": 0.25, "head_budgets": "adakv"}),
    "adakv_sink": ("sink", {"sinks": 4, "head_budgets": "adakv", "alpha_safeguard": 0.0}),
    "chunkkv_head_pyramid": ("knorm", {"chunk_length": 7, "chunk_scope": "head",
                                       "layer_budgets": {"schedule": "pyramid", "beta": 4}}),
    "kvzip_chunk": ("kvzip", {"scoring_keys": "chunk"}),
}
SEEDED_DRAWS = ("random",)  # scores drawn afresh at every call: a second call (the reference's) draws others


def spec(name: str) -> tuple[str, dict]:
    return EXTRA[name] if name in EXTRA else preset(name)


NAMES = policy_presets() + list(EXTRA)
CASES = extended_unless(NAMES, lambda name: name in CORE_POLICIES)


def prompts(lengths=LENGTHS) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    return [torch.randint(0, 256, (1, n), generator=generator) for n in lengths]


def loop_norms(values: torch.Tensor, weight: torch.Tensor, groups: int, kv_head: int) -> torch.Tensor:
    """||W_o^h v||_1 of KV head `kv_head`'s values [n, d], averaged over its `groups` query heads: float64 [n]."""
    dim = values.shape[-1]
    return sum((values.double() @ weight[:, h * dim:(h + 1) * dim].double().T).abs().sum(-1)
               for h in range(kv_head * groups, (kv_head + 1) * groups)) / groups


def scores_and_protected(policy, view: LayerView, budget: int) -> tuple[list, list]:
    """Per row and head, each entry's score and protection: the innermost scorer's, the wrappers' rules by loops."""
    if isinstance(policy, LayerBudgets):  # the cache hands each layer its own budget
        return scores_and_protected(policy.scorer, view, budget)
    positions = view.positions.tolist()
    if isinstance(policy, RecentWindow):
        scores, protected = scores_and_protected(policy.scorer, view, budget)
        window = math.floor(policy.fraction * budget + 1e-9)
        for row, heads in enumerate(positions):
            for h, pos in enumerate(heads):
                newest = set(sorted(pos, reverse=True)[:window])
                protected[row][h] = [p or q in newest for p, q in zip(protected[row][h], pos)]
        return scores, protected
    if isinstance(policy, Chunked):
        scores, protected = scores_and_protected(policy.scorer, view, budget)
        for row, heads in enumerate(positions):
            sums = [{} for _ in heads]
            for h, pos in enumerate(heads):
                for q, s in zip(pos, scores[row][h]):
                    owner, chunk = sums[h] if policy.scope == "head" else sums[0], q // policy.chunk_length
                    owner[chunk] = owner.get(chunk, 0.0) + (s if math.isfinite(s) else 0.0)
            for h, pos in enumerate(heads):  # ranked as float32 sums
                own = sums[h] if policy.scope == "head" else sums[0]
                scores[row][h] = [float(torch.tensor(own[q // policy.chunk_length]).float()) for q in pos]
        return scores, protected
    scores, protect = policy.score(view).float().tolist(), policy.protected(view, budget)
    return scores, protect.tolist() if protect is not None else [[[False] * len(p) for p in row] for row in positions]


def best(keys: list, count: int) -> list[int]:
    """Indices of the `count` largest keys."""
    return sorted(range(len(keys)), key=lambda i: keys[i], reverse=True)[:max(count, 0)]


def choose(scores, protected, positions, counts) -> list[list[int]]:
    """Per head, its protected entries, then the highest (score, position), `counts` of them in all."""
    return [sorted(pos[i] for i in best([(p, 0.0 if p else s, q) for s, p, q in zip(*head, pos)], c))
            for *head, pos, c in zip(scores, protected, positions, counts)]


def critical_choice(raw, protected, positions, norms, count, first, epsilon, log_scores) -> list[int]:
    """One head under CriticalKV: protected and the `first` best raw scores, then the best (s - min(0, s) + eps) x n."""
    stage_one = set(best([(p, s, q) for s, p, q in zip(raw, protected, positions)], first))
    stage_one |= {i for i, p in enumerate(protected) if p}
    shift = min(0.0, min(s for s in raw if math.isfinite(s)))
    rescaled = [math.log(math.exp(s) + epsilon) + math.log(max(n, 1e-30)) if log_scores else (s - shift + epsilon) * n
                for s, n in zip(raw, norms)]
    rest = [i for i in best([(rescaled[i], positions[i]) for i in range(len(raw))], len(raw)) if i not in stage_one]
    return sorted(positions[i] for i in list(stage_one) + rest[:count - len(stage_one)])


def adakv_counts(scores, protected, positions, budget, alpha) -> list[int]:
    """Entries each head keeps under AdaKV: its protected and top floor(alpha N), then the best of all heads to T."""
    safe = math.floor(alpha * budget + 1e-9)
    entries = []
    for h, (score, protect, pos) in enumerate(zip(scores, protected, positions)):
        masked = [math.inf if p else s for s, p in zip(score, protect)]
        forced = set(best([(s, q) for s, q in zip(masked, pos)], safe)) | {i for i, p in enumerate(protect) if p}
        entries += [(i in forced, masked[i], pos[i], -h) for i in range(len(pos))]
    kept = sorted(entries, reverse=True)[:len(scores) * budget]
    return [sum(1 for e in kept if -e[3] == h) for h in range(len(scores))]


def epsilon_rows(scorer, newest: int, log: dict) -> int:
    """The query rows an attention-sum scorer adds up at this eviction (CriticalKV adds epsilon per row); else 1."""
    rows, needs = scorer.needs.attention_rows, scorer.needs
    if needs.log_scores or not isinstance(rows, int) or rows <= 1 or needs.attention_reduction != "sum":
        return 1
    return 1 if log["decoding"] else min(rows, newest % BLOCK + 1)


def within_budgets(policy):
    """The policy inside per-layer budgets (the cache hands each layer its own budget)."""
    return within_budgets(policy.scorer) if isinstance(policy, LayerBudgets) else policy


def head_choices(policy, views: list[LayerView], budget: int, model, log: dict) -> list[list[int]]:
    """Each head's kept positions of one batch row by loops; `views`: one per head, or one of all the row's heads."""
    policy = within_budgets(policy)
    adaptive = isinstance(policy, HeadAdaptive)
    scorer = policy.scorer if adaptive else policy
    critical = isinstance(scorer, Critical)
    inner = scorer.scorer if critical else scorer
    found = [scores_and_protected(inner, view, budget) for view in views]
    scores, protected = [h for s, _ in found for h in s[0]], [h for _, p in found for h in p[0]]
    positions = [h for view in views for h in view.positions[0].tolist()]
    counts = [budget] * len(scores)
    if adaptive:
        ranked = [relative_scores(torch.tensor([s]), inner.needs.log_scores)[0].tolist() for s in scores] \
            if policy.head_scores == "relative" else scores
        counts = adakv_counts(ranked, protected, positions, budget, policy.alpha_safeguard)
    if not critical:
        return choose(ranked if adaptive else scores, protected, positions, counts)
    layer = views[0].layers[0]
    weight = model.model.layers[layer].self_attn.o_proj.weight.detach()
    values = [h for view in views for h in view.values[0]]
    held = [h for view in views for h in view.state[STATE][0]]
    norms = [loop_norms(v, weight, model.config.num_attention_heads // len(values), h) for h, v in enumerate(values)]
    for stored, norm in zip(held, norms):  # the stored ||W_o v||_1 of each entry
        torch.testing.assert_close(stored.double(), norm, rtol=1e-5, atol=1e-6)
    epsilon = scorer.epsilon * epsilon_rows(inner, max(max(pos) for pos in positions), log)
    safe = math.floor(policy.alpha_safeguard * budget + 1e-9) if adaptive else 0
    return [critical_choice(s, p, q, n.tolist(), c, max(math.floor(scorer.first_stage_ratio * c + 1e-9), safe), epsilon,
                            inner.needs.log_scores) if c < len(q) else sorted(q)
            for s, p, q, n, c in zip(scores, protected, positions, norms, counts)]


def one_row(view: LayerView, row: int) -> LayerView:
    """Batch row `row` of a view (its layer: the stacked views hold layers layer-major)."""
    cut, rows = slice(row, row + 1), view.positions.shape[0]
    signals = {name: value[cut] if isinstance(value, torch.Tensor) and value.shape[0] == rows
               and name != "output_projection" else value  # per-row signals cut (the o_proj weight is not)
               for name, value in view.signals.items()}
    return LayerView(view.keys[cut], view.values[cut], view.positions[cut],
                     state={n: s[cut] for n, s in view.state.items()},
                     layers=(view.layers[row * len(view.layers) // rows],), signals=signals)


def recorded(policy, model) -> tuple:
    """(variant, log): `policy` checking every choice against the loops; log: last choice per layer, count, decoding."""
    log = {"last": {}, "checked": 0, "decoding": False}
    check = policy.unwrapped().name not in SEEDED_DRAWS

    def compare(got: list, views: list[LayerView], budget: int, layer: int, row: int) -> None:
        if check:
            assert got == head_choices(policy, views, budget, model, log), f"layer {layer}: not the brute-force choice"
            log["checked"] += 1
        if row == 0:
            log["last"][layer] = got

    def evict_indices(self, layer: LayerView, budget: int) -> torch.Tensor:
        dropped = super(type(self), self).evict_indices(layer, budget)
        keep = torch.ones_like(layer.positions, dtype=torch.bool).scatter_(-1, dropped, False)
        rows, heads = keep.shape[:2]
        for row in range(rows):
            view = one_row(layer, row)
            got = [sorted(layer.positions[row, h][keep[row, h]].tolist()) for h in range(heads)]
            compare(got, [view], budget, view.layers[0], row % (rows // len(layer.layers)))
        return dropped

    def keep_heads(self, heads: list[LayerView], budget: int) -> list[torch.Tensor]:
        masks = super(type(self), self).keep_heads(heads, budget)
        got = [sorted(v.positions[0, 0][m].tolist()) for v, m in zip(heads, masks)]
        compare(got, heads, budget, heads[0].layers[0], 0)
        return masks

    def drop_segments(self, pool, budget: int) -> torch.Tensor:
        """Every pool row (layer-major: row = layer) as one-head views; head-by-head choices are keep_heads's."""
        dropped = super(type(self), self).drop_segments(pool, budget)
        if not chooses_whole_segments(self):
            return dropped
        for row in range(pool.keys.shape[0]):
            views, got = [], []
            for head in range(pool.member.shape[1]):
                slots = pool.member[row, head].nonzero().squeeze(1)
                views.append(LayerView(pool.keys[row, slots][None, None], pool.keys[row, slots][None, None],
                                       pool.positions[row, slots][None, None], None,
                                       {n: s[row, slots][None, None] for n, s in pool.state.items()}, (row,)))
                got.append(sorted(pool.positions[row, slots][~dropped[row, slots]].tolist()))
            if sum(v.positions.shape[-1] for v in views) > len(views) * budget:  # the row evicted
                compare(got, views, budget, row, 0)
        return dropped

    return variant(policy, evict_indices=evict_indices, keep_heads=keep_heads, drop_segments=drop_segments), log


def held(positions: torch.Tensor) -> list[list[int]]:
    """Row 0's sorted held positions per head (padding -1 left out)."""
    return [sorted(p for p in head if p >= 0) for head in positions[0].tolist()]


def holds_choices(cache, log: dict) -> None:
    """Every layer that has evicted holds exactly its last choice (every pass evicts once the cache is full)."""
    for layer, positions in enumerate(cache.kept_positions()):
        assert layer not in log["last"] or held(positions) == log["last"][layer], f"layer {layer}: not its choice"


def check_held(cache, log: dict, policy, length: int) -> None:
    """The cache holds each layer's last choice, within N_l + B, and exactly N_l (T = kv_heads x N_l) once exceeded."""
    adaptive = isinstance(within_budgets(policy), HeadAdaptive)
    holds_choices(cache, log)
    for layer, (positions, budget) in enumerate(zip(cache.kept_positions(), cache.layer_budgets)):
        heads = held(positions)
        if budget is None or length <= budget:
            assert heads == [list(range(length))] * len(heads) and layer not in log["last"], f"layer {layer} evicted"
            continue
        assert sum(map(len, heads)) == len(heads) * budget and (adaptive or {len(h) for h in heads} == {budget})
        assert cache.layer_max_total_entries[layer] <= len(heads) * (budget + BLOCK), f"layer {layer} broke N + B"
        assert adaptive or cache.layer_max_entries[layer] <= budget + BLOCK, f"layer {layer} broke N + B"


def run(model, name: str, path: str, lengths=LENGTHS) -> list[dict]:
    """Prefill each prompt and decode NEW tokens on `path`, every choice and the bound checked as they happen."""
    target, params = spec(name)
    fixed = path != "ordinary"
    runs = []
    for ids in prompts(lengths):
        policy, log = recorded(build_policy(target, **params), model)
        state = prefill(model, ids, policy, BUDGET, BLOCK, fixed_shapes=fixed,
                        on_block=lambda c, log=log: holds_choices(c, log))
        check_held(state.cache, log, policy, ids.shape[1])
        log["decoding"] = True
        runs.append((state, log, policy, [p.clone() for p in state.kept_positions]))
    if path == "grouped":
        requests = [Request(s, NEW, key=i) for i, (s, *_) in enumerate(runs)]
        out = dict(generate_batch(model, requests, 3, fixed_shapes=True))
        tokens = [out[i].token_ids for i in range(len(runs))]
        assert max(max(out[i].batch_sizes) for i in out) == 3
    else:
        tokens = [generate(model, state, NEW, fixed_shapes=fixed).token_ids for state, *_ in runs]
    results = []
    for (state, log, policy, prefilled), length, token_ids in zip(runs, lengths, tokens):
        if path == "ordinary":  # its own cache, evicted by its own policy alone
            check_held(state.cache, log, policy, length + NEW - 1)
        results.append({"logits": state.logits, "prefilled": prefilled, "tokens": token_ids,
                        "decoded": state.cache.kept_positions(), "checked": log["checked"]})
    return results


def same_run(a: dict, b: dict) -> bool:
    return (torch.equal(a["logits"], b["logits"]) and a["tokens"] == b["tokens"]
            and all(torch.equal(x, y) for key in ("prefilled", "decoded") for x, y in zip(a[key], b[key])))


@pytest.mark.parametrize("name", CASES)
def test_every_choice_is_the_brute_force_one_within_the_bound_and_alone_equals_every_path(model, name):
    """Ordinary step alone, fixed-shape step (where taken) and a group of three: every choice checked, same results."""
    target, params = spec(name)
    evicts = name not in SEEDED_DRAWS and name != "full"
    alone = run(model, name, "ordinary")
    assert not evicts or alone[0]["checked"] >= 3 * (LENGTHS[0] - BUDGET) // BLOCK
    for path in ("fixed", "grouped") if build_policy(target, **params).needs.capturable else ("grouped",):
        got = run(model, name, path)
        assert not evicts or got[0]["checked"], f"{name}: no choice checked on the {path} path"
        for index, (a, b) in enumerate(zip(alone, got)):
            assert same_run(a, b), f"{name}: prompt {index} on the {path} path differs from the ordinary step alone"


@pytest.mark.parametrize("name", CASES)
def test_a_budget_covering_the_prompt_is_the_full_cache(model, name):
    """N >= L + new tokens (x 25: the pyramids' top layer too): the model's own logits, `full`'s tokens."""
    target, params = spec(name)
    ids = prompts((97,))[0]
    state = prefill(model, ids, build_policy(target, **params), 25 * (97 + NEW), BLOCK)
    assert all(held(kept) == [list(range(97))] * kept.shape[1] for kept in state.kept_positions)
    with torch.no_grad():
        torch.testing.assert_close(state.logits, model(ids).logits[:, -1].float(), atol=1e-5, rtol=1e-5)
    full = prefill(model, ids, "full", None, BLOCK)
    assert generate(model, state, NEW).token_ids == generate(model, full, NEW).token_ids


@pytest.mark.extended
@pytest.mark.parametrize("name", sorted(goldens()))  # every recorded preset (test_golden says which)
def test_the_golden_holds_on_the_ordinary_step(name):
    """tests/golden/engine.json was recorded on the CPU's default step (fixed shapes where the policy allows)."""
    from tests.test_golden import BLOCK_SIZE, BUDGET as GOLDEN_BUDGET, NEW_TOKENS, golden_model, golden_prompt

    target, params = preset(name)
    model, expected = golden_model(), goldens()[name]
    torch.manual_seed(0)
    policy = build_policy(target, **params)
    state = prefill(model, golden_prompt(), policy, GOLDEN_BUDGET, BLOCK_SIZE, fixed_shapes=False)
    assert [p.sort(dim=-1).values.tolist() for p in state.kept_positions] == expected["kept_after_prefill"]
    assert generate(model, state, NEW_TOKENS, seed=0, fixed_shapes=False).token_ids == expected["tokens"]
    assert [p.tolist() for p in state.cache.kept_positions()] == expected["kept_after_decoding"]
