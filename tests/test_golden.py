"""Golden outputs: what every conf/policy preset keeps and generates on a tiny random Llama (tests/golden/engine.json),
on every CPU vector path. Record an intended change with `python -m tests.test_golden --record` (review the diff);
`--sensitivity 1 4 16 64` counts the choices a perturbation of the scores changes (docs/testing.md)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = Path(__file__).resolve().parent / "golden" / "engine.json"
PROMPT_LENGTH, BUDGET, BLOCK_SIZE, NEW_TOKENS = 700, 256, 64, 8  # budget > 2 LagKV partitions
# Weights of std 0.1 and distinct prompt tokens: no choice decided by the last bit (docs/testing.md, "Goldens on
# every vector path").
GOLDEN_MODEL = {"initializer_range": 0.1, "vocab_size": 1024}
# torch's CPU vector paths (ATEN_CPU_CAPABILITY values) and, for the best one a CPU has, the others it has too.
VECTOR_PATHS = ("default", "avx2", "avx512")
PATHS_BELOW = {"avx512": ("avx2", "default"), "avx2": ("default",)}
# Presets whose scores are ranks, positions or seeded draws: nothing rounded in them for --sensitivity to perturb.
EXACT_SCORES = ("full", "lagkv", "random", "recent", "sink")
# What the EvictingCache reports after decoding, under its own names (a refactor of its memory keeps them).
CACHE_REPORTS = ("kv_cache_bytes", "allocations", "entries_peak_sum", "max_scratch_entries")


def policy_presets() -> list[str]:
    """Every conf/policy/*.yaml except `custom` (which names no class)."""
    return sorted(p.stem for p in (ROOT / "conf" / "policy").glob("*.yaml") if p.stem != "custom")


@lru_cache(maxsize=1)
def experiment_presets() -> frozenset[str]:
    """The presets conf/experiment's grids run (the paper's experiments): a sweep's `policy` axis, else the default."""
    from hydra import compose, initialize_config_dir

    from keydiff.grids import CONF, experiment_grid, experiments, grid_axes

    used = set()
    for name in experiments():
        axes = grid_axes(experiment_grid(name))
        if "policy" not in axes:
            with initialize_config_dir(str(CONF), version_base="1.3"):
                axes["policy"] = [compose("config", overrides=[f"experiment={name}"],
                                          return_hydra_config=True).hydra.runtime.choices.policy]
        used.update(axes["policy"])
    return frozenset(used)


@lru_cache(maxsize=None)
def preset(name: str) -> tuple[str, dict]:
    """(policy class name, parameters) of conf/policy/<name>.yaml, composed by Hydra as run.py composes it."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = compose(config_name="config", overrides=[f"policy={name}"])
    return cfg.policy.name, OmegaConf.to_container(cfg.policy.params, resolve=True) or {}


def golden_model() -> torch.nn.Module:
    from tests.conftest import tiny_llama

    return tiny_llama(**GOLDEN_MODEL)


def golden_prompt() -> torch.Tensor:
    """[1, PROMPT_LENGTH] distinct token ids in random order."""
    order = torch.randperm(GOLDEN_MODEL["vocab_size"], generator=torch.Generator().manual_seed(1))
    return order[:PROMPT_LENGTH][None]


def engine_outputs(name: str, policy=None) -> dict:
    """What the golden pins for preset `name` (run with `policy` instead of the preset's own object if given)."""
    from keydiff.engine import generate, prefill
    from keydiff.policies import build_policy

    model = golden_model()
    prompt = golden_prompt()
    policy_name, params = preset(name)
    policy = build_policy(policy_name, **params) if policy is None else policy
    torch.manual_seed(0)
    with torch.no_grad():
        state = prefill(model, prompt, policy, budget=BUDGET, block_size=BLOCK_SIZE)
        kept_prefill = [p.sort(dim=-1).values.tolist() for p in state.kept_positions]
        out = generate(model, state, max_new_tokens=NEW_TOKENS, seed=0)
    return {
        "policy": policy_name,
        "params": params,
        "kept_after_prefill": kept_prefill,
        "tokens": out.token_ids,
        "kept_after_decoding": [p.tolist() for p in state.cache.kept_positions()],
        "max_cache_entries": [state.max_cache_entries, out.max_cache_entries],
        **{name: getattr(state.cache, name) for name in CACHE_REPORTS},
    }


@lru_cache(maxsize=1)
def recorded() -> dict:
    return json.loads(GOLDEN.read_text())


def differences(name: str, actual: dict, expected: dict) -> list[str]:
    """What differs between a preset's outputs and its golden, one phrase each (empty: nothing)."""
    found = [key for key in ("policy", "params", "tokens", "max_cache_entries", *CACHE_REPORTS)
             if actual[key] != expected.get(key)]
    for key in ("kept_after_prefill", "kept_after_decoding"):
        found += [f"{key} at layer {layer}" for layer, (got, want) in enumerate(zip(actual[key], expected[key], strict=True))
                  if got != want]
    return [f"{name}: {what}" for what in found]


@pytest.mark.extended
@pytest.mark.parametrize("name", sorted(recorded()))
def test_every_recorded_preset_keeps_and_generates_what_was_recorded(name):
    found = differences(name, engine_outputs(name), recorded()[name])
    assert not found, "; ".join(found)


@pytest.mark.unit
def test_the_goldens_cover_every_preset_the_experiments_run_and_only_presets():
    """A preset added since the last --record (a new policy's) has none until the next: its own test pins it."""
    missing = sorted(experiment_presets() - set(recorded()))
    assert not missing, f"no golden output for preset(s) {missing}: record them (python -m tests.test_golden --record)"
    assert set(recorded()) <= set(policy_presets()), "a golden output for a preset conf/policy no longer has"


def best_vector_path() -> str:
    """The path torch takes on this CPU when ATEN_CPU_CAPABILITY does not choose one (its best)."""
    if "ATEN_CPU_CAPABILITY" not in os.environ:
        return torch.backends.cpu.get_cpu_capability().lower()
    env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
    probe = "import torch; print(torch.backends.cpu.get_cpu_capability())"
    return subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True,
                          timeout=120).stdout.strip().lower()


@pytest.mark.slow
@pytest.mark.parametrize("path", [p for p in VECTOR_PATHS if p != torch.backends.cpu.get_cpu_capability().lower()])
def test_the_goldens_hold_on_every_other_vector_path_this_cpu_has(path):
    """Each other path this CPU has runs the goldens in a child process (a path it lacks cannot be forced)."""
    best = best_vector_path()
    if path != best and path not in PATHS_BELOW.get(best, ("default",)):
        pytest.skip(f"this CPU has no {path.upper()} path (torch's best here: {best.upper()})")
    env = {**os.environ, "ATEN_CPU_CAPABILITY": path, "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-m", "tests.test_golden", "--print"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    child = json.loads(result.stdout.splitlines()[-1])
    assert child["capability"] == path.upper(), f"asked for {path}, the child ran on {child['capability']}"
    found = [line for name in recorded() for line in differences(name, child["outputs"][name], recorded()[name])]
    assert not found, f"on torch's {path.upper()} path: " + "; ".join(found)


def record() -> None:
    GOLDEN.parent.mkdir(exist_ok=True)
    outputs = {name: engine_outputs(name) for name in policy_presets()}
    lines = [f"{json.dumps(name)}: {json.dumps(outputs[name], sort_keys=True)}" for name in sorted(outputs)]
    GOLDEN.write_text("{\n" + ",\n".join(lines) + "\n}\n")  # one preset per line: reviewable diffs
    print(f"recorded {len(outputs)} presets in {GOLDEN.relative_to(ROOT)}")


def sensitivity(name: str, ulps: float, draws: int = 2) -> tuple[int, int]:
    """(choices, changed) when each choice of preset `name` is made again `draws` times with the scores times
    (1 + ulps x 2^-23 x u), u uniform in [-1, 1]; the run goes on with the unperturbed choice (docs/testing.md)."""
    from keydiff.policies import build_policy
    from keydiff.policies.wrappers import PolicyWrapper
    from keydiff.testing import variant

    noise = {"on": False, "generator": torch.Generator().manual_seed(0)}
    counts = [0, 0]

    def perturbed(scores: torch.Tensor) -> torch.Tensor:
        if not noise["on"]:
            return scores
        u = torch.rand(scores.shape, generator=noise["generator"], dtype=torch.float64) * 2 - 1
        return (scores.double() * (1 + ulps * 2.0**-23 * u)).to(scores.dtype)

    def again(choose, same) -> None:
        """Count the choices `choose()` makes differently with perturbed scores; `same(other)`: per choice."""
        for _ in range(draws):
            noise["on"] = True
            try:
                agree = same(choose())
            finally:
                noise["on"] = False
            counts[0] += agree.numel()
            counts[1] += int((~agree).sum())

    def evict_indices(self, layer, budget):
        chosen = super(type(self), self).evict_indices(layer, budget)
        again(lambda: super(type(self), self).evict_indices(layer, budget),
              lambda other: (other.sort(dim=-1).values == chosen.sort(dim=-1).values).all(dim=-1))
        return chosen

    def keep_heads(self, heads, budget):
        chosen = super(type(self), self).keep_heads(heads, budget)
        again(lambda: super(type(self), self).keep_heads(heads, budget),
              lambda other: torch.tensor([all(torch.equal(a, b) for a, b in zip(chosen, other))]))
        return chosen

    def drop_segments(self, pool, budget):
        chosen = super(type(self), self).drop_segments(pool, budget)
        if not self.chooses_segments:  # head by head: each row's choice is counted by keep_heads
            return chosen
        again(lambda: super(type(self), self).drop_segments(pool, budget), lambda other: (other == chosen).all(dim=-1))
        return chosen

    def rebuilt(policy, scorer):
        """`policy` with its innermost scorer replaced by `scorer` (each wrapper rebuilt around it)."""
        if isinstance(policy, PolicyWrapper):
            return dataclasses.replace(policy, scorer=rebuilt(policy.scorer, scorer))
        return scorer

    policy_name, params = preset(name)
    policy = build_policy(policy_name, **params)
    inner = policy.unwrapped()
    scorer = variant(inner, score=lambda self, layer: perturbed(type(inner).score(self, layer)),
                     score_segments=lambda self, pool: perturbed(type(inner).score_segments(self, pool)))
    choosing = variant(rebuilt(policy, scorer), evict_indices=evict_indices, keep_heads=keep_heads, drop_segments=drop_segments)
    engine_outputs(name, choosing)
    return counts[0], counts[1]


def print_sensitivity(ulps_list: list[float]) -> None:
    print(f"choices changed by a perturbation of the scores (golden setting, torch path "
          f"{torch.backends.cpu.get_cpu_capability()}): " + ", ".join(f"{u:g} ULPs" for u in ulps_list))
    for name in policy_presets():
        if preset(name)[0] in EXACT_SCORES:
            print(f"  {name:28s} exact scores (ranks, positions or seeded draws): not perturbed")
            continue
        cells = []
        for ulps in ulps_list:
            choices, changed = sensitivity(name, ulps)
            cells.append(f"{changed:3d} of {choices:4d}")
        print(f"  {name:28s} " + "   ".join(cells), flush=True)


if __name__ == "__main__":
    arguments = sys.argv[1:]
    if arguments == ["--record"]:
        record()
    elif arguments == ["--print"]:  # the other-path test's child: this path's outputs, as JSON
        outputs = {name: engine_outputs(name) for name in policy_presets()}
        print(json.dumps({"capability": torch.backends.cpu.get_cpu_capability(), "outputs": outputs}))
    elif arguments[:1] == ["--sensitivity"] and len(arguments) > 1:
        print_sensitivity([float(value) for value in arguments[1:]])
    else:
        sys.exit("usage: python -m tests.test_golden --record | --sensitivity ULPS [ULPS ...]")
