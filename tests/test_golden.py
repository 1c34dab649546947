"""Golden outputs: what every policy preset keeps and generates must not change when the code is reshaped.

A refactor changes no output. This file pins, for every preset in conf/policy/ (the built-ins with the
parameters the paper's experiments use), on the tiny random model of tests/conftest.py:
  * the absolute prompt positions each layer and KV head keeps after block-wise prefill,
  * the greedy tokens generated afterwards (with eviction after every token),
  * the positions kept after decoding and the peak entries per head.
Recorded values live in tests/golden/engine.json. An intended change of output is recorded again with

    python -m tests.test_golden --record

and the diff of the JSON file is then part of the commit that changes the output (review it).
"""

from __future__ import annotations

import json
import sys
from functools import lru_cache
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = Path(__file__).resolve().parent / "golden" / "engine.json"
PROMPT_LENGTH, BUDGET, BLOCK_SIZE, NEW_TOKENS = 700, 256, 64, 8  # budget > 2 LagKV partitions


def policy_presets() -> list[str]:
    """Every conf/policy/*.yaml except `custom` (which names no class)."""
    return sorted(p.stem for p in (ROOT / "conf" / "policy").glob("*.yaml") if p.stem != "custom")


@lru_cache(maxsize=None)
def preset(name: str) -> tuple[str, dict]:
    """(policy class name, parameters) of conf/policy/<name>.yaml, composed by Hydra as run.py composes it."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = compose(config_name="config", overrides=[f"policy={name}"])
    return cfg.policy.name, OmegaConf.to_container(cfg.policy.params, resolve=True) or {}


def engine_outputs(name: str) -> dict:
    from keydiff.engine import generate, prefill
    from keydiff.policies import build_policy
    from tests.conftest import tiny_llama

    model = tiny_llama()
    prompt = torch.randint(0, 256, (1, PROMPT_LENGTH), generator=torch.Generator().manual_seed(1))
    policy_name, params = preset(name)
    policy = build_policy(policy_name, **params)
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
    }


@lru_cache(maxsize=1)
def recorded() -> dict:
    return json.loads(GOLDEN.read_text())


@pytest.mark.parametrize("name", policy_presets())
def test_every_policy_preset_keeps_and_generates_what_was_recorded(name):
    expected = recorded().get(name)
    assert expected is not None, f"no golden output for preset {name!r}: record it (python -m tests.test_golden --record)"
    actual = engine_outputs(name)
    for key in ("policy", "params", "tokens", "max_cache_entries"):
        assert actual[key] == expected[key], (name, key)
    for key in ("kept_after_prefill", "kept_after_decoding"):
        for layer, (got, want) in enumerate(zip(actual[key], expected[key], strict=True)):
            assert got == want, f"{name}: {key} differs at layer {layer}"


def test_golden_file_covers_exactly_the_presets():
    assert sorted(recorded()) == policy_presets()


def record() -> None:
    GOLDEN.parent.mkdir(exist_ok=True)
    outputs = {name: engine_outputs(name) for name in policy_presets()}
    lines = [f"{json.dumps(name)}: {json.dumps(outputs[name], sort_keys=True)}" for name in sorted(outputs)]
    GOLDEN.write_text("{\n" + ",\n".join(lines) + "\n}\n")  # one preset per line: reviewable diffs
    print(f"recorded {len(outputs)} presets in {GOLDEN.relative_to(ROOT)}")


if __name__ == "__main__":
    if sys.argv[1:] != ["--record"]:
        sys.exit("usage: python -m tests.test_golden --record")
    record()
