"""Eviction policies, built by name: `build_policy("keydiff", window_fraction=0.2)`.

Each policy is one small dataclass in its own module; `POLICIES` maps config names to classes, and a dotted
path names a policy written elsewhere. `build_policy` composes wrappers (recent window, ChunkKV, CriticalKV,
AdaKV, key re-rotation, layer budgets) from the configs' flat parameters. Design: docs/design/policies.md

    base         what a policy is (Policy, Needs, LayerView), and layer_by_layer, the reference of a stacked choice
    wrappers     a recent window and per-layer budgets around any policy
    chunkkv      ChunkKV: whole chunks of consecutive positions, around any policy
    criticalkv   CriticalKV: output-aware scores, around any policy
    adakv        AdaKV: head-adaptive budgets within a layer, around any policy
    layer_budgets  how a budget is split across layers (uniform, PyramidKV)
    rerotation   key re-rotation after eviction
    capabilities every preset's needs as data (capabilities.json), for the modules that import no torch

Every other module is one policy, named by its conf/policy file: a class there stating its config `name` registers
itself (`Policy.__init_subclass__`) and this package imports each module of its folder, so a new policy is its
module, its conf/policy/<name>.yaml and its test (docs/policies.md#adding-a-built-in-policy); the built-ins are
`available_policies()`, described in docs/policies.md's table.
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from typing import Any

from keydiff.policies.adakv import HEAD_BUDGETS, REROTATION_REFUSED, HeadAdaptive, check_alpha, check_head_scores
from keydiff.policies.base import BUILT_IN, LayerView, Needs, Policy, layer_by_layer
from keydiff.policies.chunkkv import Chunked
from keydiff.policies.criticalkv import Critical
from keydiff.policies.rerotation import Rerotated, rerotation_mode
from keydiff.policies.wrappers import LayerBudgets, PolicyWrapper, RecentWindow

COMMANDS = ("capabilities",)  # run as `python -m`, not imported here (runpy warns about a module imported before)
for _module in pkgutil.iter_modules(__path__):
    if _module.name not in COMMANDS:
        importlib.import_module(f"{__name__}.{_module.name}")
del _module

POLICIES: dict[str, type[Policy]] = dict(sorted(BUILT_IN.items()))
globals().update({cls.__name__: cls for cls in POLICIES.values()})  # keydiff.policies.KNorm, as every name here


def available_policies() -> list[str]:
    return sorted(POLICIES)


def policy_class(name: str) -> type[Policy]:
    """The class for a built-in name or a dotted path `package.module.Class`; ValueError saying which part is wrong."""
    if name in POLICIES:
        return POLICIES[name]
    if "." not in name:
        raise ValueError(
            f"unknown policy {name!r}; valid policies: {', '.join(available_policies())}, "
            "or a class of your own as a dotted path (policy=custom policy.target=my_module.MyPolicy)"
        )
    module_name, _, class_name = name.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        raise ValueError(
            f"policy target {name!r}: cannot import module {module_name!r} ({error}); is its folder on PYTHONPATH?"
        ) from error
    cls = getattr(module, class_name, None)
    if cls is None:
        raise ValueError(f"policy target {name!r}: module {module_name!r} has no attribute {class_name!r}")
    if not (isinstance(cls, type) and issubclass(cls, Policy)):
        raise ValueError(f"policy target {name!r} is not a subclass of keydiff.policies.Policy (got {cls!r})")
    require_own_dataclass(cls, f"policy target {name!r}")
    return cls


def require_own_dataclass(cls: type[Policy], what: str) -> None:
    """Raise ValueError (starting with `what`) unless `cls` and every Policy class it inherits from is itself a @dataclass."""
    undecorated = [
        klass.__qualname__ for klass in cls.__mro__
        if issubclass(klass, Policy) and "__dataclass_fields__" not in vars(klass)
    ]
    if undecorated:
        raise ValueError(
            f"{what}: {', '.join(undecorated)} must be decorated with @dataclass "
            "(its fields are its parameters; without it they are neither settable nor recorded)"
        )


def policy_parameters(cls: type[Policy]) -> list[str]:
    """The parameters `build_policy` takes for `cls`: its fields, its window name (if any), then every policy's wrapper parameters."""
    own = [f.name for f in dataclasses.fields(cls) if f.init]
    window = [cls.recent_window_parameter] if cls.recent_window_parameter else []
    return own + window + ["chunk_length", "chunk_scope", *CRITICAL_PARAMETERS, "head_budgets", "alpha_safeguard",
                           "head_scores", "key_rerotation", "layer_budgets"]


CRITICAL_PARAMETERS = ("critical", "critical_epsilon", "first_stage_ratio")


def critical_wrapper(policy: Policy, params: dict[str, Any]) -> Policy:
    """`policy` in a Critical wrapper when `critical` is true; its epsilon or ratio without `critical: true` is an error."""
    critical = params.pop("critical", False)
    options = {name: params.pop(name) for name in CRITICAL_PARAMETERS[1:] if name in params}
    if not isinstance(critical, bool):
        raise ValueError(f"critical must be true or false, got {critical!r}")
    if not critical:
        if options:
            raise ValueError(f"{', '.join(options)} given without critical: true (CriticalKV); set critical: true or drop them")
        return policy
    return Critical(policy, **{"epsilon" if name == "critical_epsilon" else name: value for name, value in options.items()})


def compose_policy(cls: type[Policy], **params: Any) -> Policy:
    """`cls` built with its own parameters inside the wrappers the others name, innermost first (docs/design/policies.md)."""
    params = dict(params)
    schedule = params.pop("layer_budgets", None)
    chunk_length = params.pop("chunk_length", None)
    chunk_scope = params.pop("chunk_scope", "layer")
    rerotation = rerotation_mode(params.pop("key_rerotation", None))
    head_budgets = params.pop("head_budgets", "uniform")
    alpha = params.pop("alpha_safeguard", None)
    head_scores = params.pop("head_scores", None)
    check_head_budgets(head_budgets, alpha, head_scores)
    if head_budgets == "adakv" and rerotation is not None:
        raise ValueError(REROTATION_REFUSED)  # the others are refused by HeadAdaptive itself
    window = cls.recent_window_parameter
    fraction = params.pop(window, 0.0) if window else None
    critical_params = {name: params.pop(name) for name in CRITICAL_PARAMETERS if name in params}
    policy: Policy = cls(**params)
    if fraction is not None:
        policy = RecentWindow(policy, fraction=fraction)
    if chunk_length is not None:
        policy = Chunked(policy, chunk_length=chunk_length, scope=chunk_scope)
    policy = critical_wrapper(policy, critical_params)
    if head_budgets == "adakv":
        policy = HeadAdaptive(policy, alpha_safeguard=0.2 if alpha is None else alpha,
                              head_scores="raw" if head_scores is None else head_scores)
    if rerotation is not None:
        policy = Rerotated(policy, mode=rerotation)
    if schedule is not None:
        policy = LayerBudgets(policy, schedule=schedule)
    return policy


def check_head_budgets(head_budgets: Any, alpha: Any, head_scores: Any = None) -> None:
    """One-line errors for the flat AdaKV parameters (before any model is loaded)."""
    if head_budgets not in HEAD_BUDGETS:
        raise ValueError(f"unknown head_budgets {head_budgets!r}; valid: {', '.join(HEAD_BUDGETS)}")
    if head_scores is not None:
        if head_budgets != "adakv":
            raise ValueError("head_scores applies only to head-adaptive budgets: set head_budgets=adakv or drop it")
        check_head_scores(head_scores)
    if alpha is not None:
        if head_budgets != "adakv":
            raise ValueError("alpha_safeguard applies only to head-adaptive budgets: set head_budgets=adakv or drop it")
        check_alpha(alpha)


def build_policy(name: str, **params: Any) -> Policy:
    """Instantiate the policy `name` (built-in or dotted path) with `params`; ValueError naming the valid policies or parameters."""
    cls = policy_class(name)
    valid = policy_parameters(cls)
    unknown = sorted(set(params) - set(valid))
    if unknown:
        raise ValueError(
            f"policy {name!r} has no parameter(s) {', '.join(unknown)}; valid: {', '.join(valid) or '(none)'}"
        )
    return compose_policy(cls, **params)


__all__ = ["POLICIES", "Chunked", "Critical", "HeadAdaptive", "LayerBudgets", "Rerotated", "LayerView", "Needs", "Policy", "PolicyWrapper", "RecentWindow", "available_policies", "build_policy",
           "compose_policy", "layer_by_layer", "policy_class", "policy_parameters", "require_own_dataclass"] + [c.__name__ for c in POLICIES.values()]
