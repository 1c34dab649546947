"""What a run will do, decided from its configuration before any model is loaded: the policy, budget, block size,
protocol, task and model (`RunPlan`, `plan_run`), and which configuration keys decide its results
(`result_config`: what a resumed run directory must match).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from keydiff.engine import check_budget, resolve_block_size
from keydiff.models import ModelConfig
from keydiff.policies import Policy, build_policy
from keydiff.tasks.base import Prompt, Task

# Keys that do not change what a run computes, so changing them never blocks resuming a run directory
# (max_prompt_tokens only decides which samples fail; shard only which of the grid point's samples a directory holds).
NON_RESULT_KEYS = ("overwrite", "logger", "results_root", "experiment_name", "run_subdir", "slurm", "threads",
                   "batch_size", "max_prompt_tokens", "retry_failed", "lock_wait", "dry_run", "only_missing",
                   "shard")


@dataclass
class RunPlan:
    """Everything checked and built before the model is loaded."""

    policy_name: str
    policy_params: dict[str, Any]
    budget: int | None
    block_size: int | None
    statistics: str
    decode_eviction: bool
    task: Task
    model_cfg: ModelConfig
    ratio: float | None = None  # a ratio budget (budget.ratio): N is set per sample from its prompt length
    # False: kvpress's query-agnostic protocol (the context compressed, the question held: engine's held_suffix)
    query_aware: bool = True
    # Decoding steps with kernels whose reduction order does not depend on the batch (keydiff.kernels.batch_invariant)
    batch_invariant: bool = False

    def new_policy(self) -> Policy:
        """A fresh policy per sample, so stateful policies (random) do not depend on sample order."""
        return build_policy(self.policy_name, **self.policy_params)

    @property
    def evicts(self) -> bool:
        return self.budget is not None or self.ratio is not None

    def build_prompt(self, sample, tokenizer) -> Prompt:
        """The task's prompt for this protocol (query_aware=False asks the task for its context/question split)."""
        extra = {} if self.query_aware else {"query_aware": False}
        return self.task.build_prompt(sample, tokenizer, self.model_cfg.max_length, **extra)

    def compressed_tokens(self, prompt: Prompt) -> int:
        """The tokens eviction sees, what a ratio budget counts: the prompt, or its context (query_aware=False)."""
        return len(prompt.input_ids) if prompt.context_tokens is None else prompt.context_tokens

    def sample_budget(self, prompt_tokens: int) -> int | None:
        """N for a prompt of this length: the token budget, or ceil(ratio x prompt tokens), at least 1."""
        if self.ratio is None:
            return self.budget
        return max(1, math.ceil(self.ratio * prompt_tokens))


def plan_run(cfg: DictConfig) -> RunPlan:
    """Build the run from a configuration that passed check_run_config, without loading the model: adds the
    checks that need the policy classes (parameters, budget). Raises ValueError with valid choices."""
    raw = cfg.policy.get("params")
    params = OmegaConf.to_container(raw, resolve=True) if raw is not None else {}
    policy_name = policy_target(cfg.policy)
    policy = build_policy(policy_name, **params)
    # A ratio budget's N is known per sample only: the policy's own constraints are checked against each
    # sample's N (process_sample records a sample whose N they refuse as failed, "budget_too_small").
    ratio = cfg.budget.get("ratio") if policy.needs.evicts else None
    budget = cfg.budget.tokens
    if ratio is None:
        check_budget(policy, budget)
    block_size = resolve_block_size(cfg.block_size)
    task = instantiate(cfg.task, _convert_="all")
    model_cfg = ModelConfig.from_dict(OmegaConf.to_container(cfg.model, resolve=True))
    return RunPlan(policy_name, params, int(budget) if policy.needs.evicts and ratio is None else None, block_size,
                   cfg.attention_statistics, cfg.get("decode_eviction", True), task, model_cfg,
                   None if ratio is None else float(ratio), bool(cfg.get("query_aware", True)),
                   bool(cfg.get("batch_invariant", False)))


def policy_target(policy_cfg: DictConfig) -> str:
    """What build_policy gets: the built-in name, or for `policy=custom` the class path in `policy.target`."""
    target = policy_cfg.get("target")
    if policy_cfg.name == "custom" and not target:
        raise ValueError("policy=custom needs policy.target=<module>.<Class>, e.g. policy.target=my_lab.policies.MyPolicy")
    return target or policy_cfg.name


def result_config(cfg: DictConfig) -> dict[str, Any]:
    """The part of the config that determines the results: what a resumed run must match. task.limit stays in (a
    larger limit extends a run); batch_invariant only when true and task.haystack_source unless "interpreter", so
    directories written before those keys existed resume as they are."""
    data = OmegaConf.to_container(cfg, resolve=True)
    for key in NON_RESULT_KEYS:
        data.pop(key, None)
    if not data.get("batch_invariant", False):
        data.pop("batch_invariant", None)
    task = data.get("task")
    if isinstance(task, dict) and task.get("haystack_source") == "interpreter":  # what runs before the key read:
        data["task"] = {k: v for k, v in task.items() if k != "haystack_source"}  # their directories resume with it
    return data
