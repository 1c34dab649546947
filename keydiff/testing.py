"""Check an eviction policy against the contract in one line: `keydiff.testing.check_policy(MyPolicy, alpha=0.3)`, on a
tiny random Llama (no download). A failure raises `PolicyCheckError` naming the property. The contract:
docs/policies.md."""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import fields, replace
from typing import Any

import torch

from keydiff.engine import generate, prefill
from keydiff.policies import LayerBudgets, LayerView, Policy, compose_policy, policy_class, require_own_dataclass
from keydiff.policies.base import chooses_whole_segments


class PolicyCheckError(AssertionError):
    """A policy broke the contract `check_policy` checks (the message says which part)."""


def tiny_model(seed: int = 0) -> torch.nn.Module:
    """3 layers, 4 query heads over 2 KV heads (GQA groups of 2), head_dim 16, random weights (float32)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                         attn_implementation="sdpa")
    with torch.random.fork_rng(devices=[]):  # the caller's random state is left as it was
        torch.manual_seed(seed)
        return LlamaForCausalLM(config).float().eval()


HYBRID_ARCHITECTURES = ("gemma2", "gemma3", "gpt_oss", "mistral_sliding")


def tiny_hybrid_model(architecture: str, window: int = 48, seed: int = 0) -> torch.nn.Module:
    """A tiny random float32 model with sliding-window layers (4 layers alternating sliding and full; `mistral_sliding`:
    every layer slides), in its default attention implementation; gpt-oss's sinks are drawn at random."""
    import transformers

    shape = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, sliding_window=window, max_position_embeddings=4096)
    alternating = ["sliding_attention", "full_attention"] * 2
    builders = {
        "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(layer_types=alternating, query_pre_attn_scalar=16)),
        "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(layer_types=alternating, query_pre_attn_scalar=16)),
        "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(layer_types=alternating, num_local_experts=4,
                                                              num_experts_per_tok=2, intermediate_size=64)),
        "mistral_sliding": ("MistralConfig", "MistralForCausalLM", {}),
    }
    if architecture not in builders:
        raise ValueError(f"unknown architecture {architecture!r}; valid: {', '.join(builders)}")
    config_name, model_name, extra = builders[architecture]
    config = getattr(transformers, config_name)(**{**shape, **extra})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = getattr(transformers, model_name)(config).float().eval()
        for layer in model.model.layers:
            sinks = getattr(layer.self_attn, "sinks", None)
            if sinks is not None:
                sinks.data.normal_(0.0, 1.0)
    return model


def variant(policy: Policy, **class_attributes: Any) -> Policy:
    """The same policy (parameters and behaviour) as an instance of a subclass with `class_attributes` set."""
    cls = type(policy)
    names = {"__module__": cls.__module__, "__qualname__": cls.__qualname__}  # errors name the class checked
    sub = type(cls.__name__, (cls,), {**names, **class_attributes})
    return sub(**{f.name: getattr(policy, f.name) for f in fields(policy) if f.init})


def counting(policy: Policy, rows_alike: bool, **needs: Any) -> tuple[Policy, list[int]]:
    """A variant that checks its scores at every eviction (not only the first) and counts the evictions; its needs
    are the policy's with `rows_alike` and `needs` (Needs fields) set."""
    calls: list[int] = []

    def evict_indices(self: Policy, layer: LayerView, budget: int) -> torch.Tensor:
        calls.append(layer.positions.shape[-1] - budget)
        return super(type(self), self).evict_indices(layer, budget)

    def keep_heads(self: Policy, heads: list[LayerView], budget: int) -> list[torch.Tensor]:  # head-adaptive
        calls.append(sum(head.positions.shape[-1] for head in heads) - len(heads) * budget)
        return super(type(self), self).keep_heads(heads, budget)

    def drop_segments(self: Policy, segments, budget: int) -> torch.Tensor:  # head by head: keep_heads counts
        if chooses_whole_segments(self):  # all segments of a row at once
            calls.append(int((segments.counts.sum(dim=1) - segments.counts.shape[1] * budget).clamp_min(0).sum()))
        return super(type(self), self).drop_segments(segments, budget)

    checked = variant(policy, needs=replace(policy.needs, rows_alike=rows_alike, **needs), _check_every_call=True,
                      evict_indices=evict_indices, keep_heads=keep_heads, drop_segments=drop_segments)
    return checked, calls


def run_once(
    policy: Policy, model: torch.nn.Module, ids: torch.Tensor, budget: int, block_size: int, new_tokens: int,
    decoder=None,
) -> dict:
    """Prefill and decode once (through `decoder`, a keydiff.decode.Decoder, if given); what the checks compare
    (kept positions, tokens, per-layer entries)."""
    state = prefill(model, ids, policy, budget=budget, block_size=block_size, decoder=decoder)
    stacked = state.cache.stack is not None
    out = generate(model, state, new_tokens, decoder=decoder)
    return {
        "kept": [kept.clone() for kept in state.cache.kept_positions()],
        "tokens": out.token_ids,
        "budgets": state.cache.layer_budgets,
        "max_entries": state.cache.layer_max_entries,  # each layer's peak entries per head, decoding included
        "entries": [layer.num_entries for layer in state.cache.layers],
        "stacked": stacked,
    }


def check_policy(
    policy: type[Policy] | str | Policy,
    *,
    budget: int = 48,
    prompt_tokens: int = 160,
    block_size: int = 16,
    new_tokens: int = 4,
    deterministic: bool = True,
    model: torch.nn.Module | None = None,
    **params: Any,
) -> dict:
    """Check `policy` (a Policy subclass, built-in name or dotted path built with `params`, or a policy object) against
    the contract. budget must be below prompt_tokens. deterministic=False skips the repeat check. model: default
    `tiny_model()`. Raises PolicyCheckError (or the policy's ValueError); returns a summary."""
    fresh = policy_factory(policy, params)
    if budget >= prompt_tokens:
        raise ValueError(f"budget ({budget}) must be smaller than prompt_tokens ({prompt_tokens}) for the policy to evict")
    base = fresh()
    base.check(budget)
    name = base.describe()["name"]
    start = time.perf_counter()
    model = tiny_model() if model is None else model
    ids = torch.randint(0, 256, (1, prompt_tokens), generator=torch.Generator().manual_seed(0))

    def run(rows_alike: bool, factory: Callable[[], Policy] = fresh, **needs: Any) -> tuple[dict, list[int]]:
        checked, calls = counting(factory(), rows_alike, **needs)
        try:
            return run_once(checked, model, ids, budget, block_size, new_tokens), calls
        except RuntimeError as error:  # check_scores names the checked subclass's policy: say which check it was
            raise PolicyCheckError(f"{name}: {error}") from error

    first, calls = run(base.needs.rows_alike)
    if base.needs.evicts:
        if not calls:
            raise PolicyCheckError(f"{name}: never evicted a {prompt_tokens}-token prompt under a budget of {budget}")
        for layer, (layer_budget, peak, held) in enumerate(zip(first["budgets"], first["max_entries"], first["entries"])):
            if layer_budget is None:
                continue
            if peak > layer_budget + block_size or held != layer_budget:
                raise PolicyCheckError(
                    f"{name}: layer {layer} broke the N + B bound: budget {layer_budget}, block {block_size}, "
                    f"peak {peak} entries per head, {held} held at the end (expected exactly {layer_budget})"
                )
    if deterministic:
        second, _ = run(base.needs.rows_alike)
        compare(name, "a second run with a fresh policy object", first, second)
    batchable_checked = False
    if base.needs.rows_alike:
        # The cache stacks layers only when every layer has the same budget: with per-layer budgets (a pyramid)
        # the comparison would be layer-by-layer against layer-by-layer, so it then runs with uniform budgets.
        uniform = fresh if first["stacked"] else uniform_factory(policy, params)
        stacked = first if first["stacked"] else run(True, uniform)[0]
        if not stacked["stacked"] and None not in stacked["budgets"]:
            raise PolicyCheckError(f"{name}: claims needs.rows_alike but the cache did not stack its layers "
                                   "(uniform budgets), so stacked eviction could not be compared")
        if stacked["stacked"]:  # else some layer is never evicted (e.g. skip_layers): the cache never stacks
            unstacked, _ = run(False, uniform)
            compare(name, "layer-by-layer eviction (it claims needs.rows_alike)", stacked, unstacked)
            batchable_checked = True
    captured_checked = False
    if base.needs.capturable and first["stacked"]:  # the fixed-shape step takes only a stacked cache
        captured, graphs = run_captured(fresh(), model, ids, budget, block_size, new_tokens)
        if graphs["failed"] or graphs["stopped"]:
            raise PolicyCheckError(
                f"{name}: claims needs.capturable but its eviction could not be captured in a CUDA graph (stood in "
                f"for on the CPU): {graphs['reasons']}; a host read (.item(), .tolist(), int() of a tensor, a branch "
                "on a value) or a value-dependent shape does that: set host_reads=True")
        if graphs["captured"]:  # none: the fixed-shape step does not take this model's cache (sliding layers)
            compare(name, "the captured fixed-shape step (it claims needs.capturable)", first, captured)
            captured_checked = True
    segments_checked = False
    if base.needs.chooses_segments:  # head-adaptive, all layers' segments chosen at once: as head by head
        per_head, _ = run(base.needs.rows_alike, segment_scores=False)
        compare(name, "head-by-head choice (it chooses on all segments at once)", first, per_head)
        segments_checked = True
    return {"policy": name, "budget": budget, "layer_budgets": first["budgets"], "evictions": len(calls),
            "stacked": first["stacked"], "batchable_checked": batchable_checked, "segments_checked": segments_checked,
            "captured_checked": captured_checked,
            "seconds": round(time.perf_counter() - start, 2)}


def run_captured(policy: Policy, model: torch.nn.Module, ids: torch.Tensor, budget: int, block_size: int,
                 new_tokens: int) -> tuple[dict, dict]:
    """`run_once` through one Decoder with CUDA graphs stood in for on the CPU (keydiff.decode.graphs), where a host
    read inside a capture fails it, as on a GPU. The run, and the graphs' record (captured, failed, reasons, stopped).
    """
    from keydiff.decode import Decoder
    from keydiff.decode.graphs import stand_in_graphs

    decoder = Decoder(model, 1)
    with stand_in_graphs():
        run = run_once(policy, model, ids, budget, block_size, new_tokens, decoder=decoder)
    return run, decoder.stats.record()


def policy_factory(policy: type[Policy] | str | Policy, params: dict[str, Any]) -> Callable[[], Policy]:
    """A function returning a fresh policy object per call (each run starts from a policy that has seen nothing)."""
    if isinstance(policy, Policy):
        if params:
            raise TypeError(f"check_policy takes parameters with a class or a name, not with a policy object ({sorted(params)})")
        return lambda: copy.deepcopy(policy)
    cls = policy_class(policy) if isinstance(policy, str) else policy
    if not (isinstance(cls, type) and issubclass(cls, Policy)):
        raise TypeError(f"check_policy takes a Policy subclass, a policy name or a Policy object, got {policy!r}")
    require_own_dataclass(cls, f"policy class {cls.__module__}.{cls.__qualname__}")  # as run.py would refuse it
    return lambda: compose_policy(cls, **params)


def uniform_factory(policy: type[Policy] | str | Policy, params: dict[str, Any]) -> Callable[[], Policy]:
    """The same policy with one budget for every layer, for the stacked comparison (stacks need equal budgets)."""
    if isinstance(policy, Policy):
        def strip(p: Policy) -> Policy:
            return strip(p.scorer) if isinstance(p, LayerBudgets) else p
        return lambda: copy.deepcopy(strip(policy))
    return policy_factory(policy, {k: v for k, v in params.items() if k != "layer_budgets"})


def compare(name: str, what: str, expected: dict, got: dict) -> None:
    """Raise PolicyCheckError naming the first layer whose kept positions (or the tokens) differ."""
    for layer, (a, b) in enumerate(zip(expected["kept"], got["kept"])):
        if a.shape != b.shape or not torch.equal(a, b):
            heads = [h for h in range(a.shape[1]) if a.shape != b.shape or not torch.equal(a[:, h], b[:, h])]
            raise PolicyCheckError(f"{name}: {what} kept other positions in layer {layer} (KV heads {heads})")
    if expected["tokens"] != got["tokens"]:
        raise PolicyCheckError(f"{name}: {what} generated other tokens ({expected['tokens']} vs {got['tokens']})")


__all__ = ["PolicyCheckError", "check_policy", "tiny_model"]
