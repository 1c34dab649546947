"""Golden batched decoding (tests/golden/batching.json): per sequence its tokens, finish reason, batch sizes, kept
positions and bytes, for prompts apart at batch 1 and 4 and forks, on each cache layout. An intended change is
recorded again with `python -m tests.test_golden_batching --record` (review the JSON diff in its commit)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = Path(__file__).resolve().parent / "golden" / "batching.json"
BUDGET, BLOCK = 40, 16
CASES = {  # name -> (policy, parameters)
    "keydiff": ("keydiff", {}),
    "snapkv": ("snapkv", {}),
    "full": ("full", {}),
    "adakv_keydiff": ("keydiff", {"head_budgets": "adakv"}),
}
LENGTHS = (90, 23, 130, 61, 45, 77)  # one prompt shorter than N (23 < 40)


def prompts() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    return [torch.randint(0, 256, (1, n), generator=generator) for n in LENGTHS]


def settings(key: int) -> dict:
    """Different lengths, stop rules and sampling per sequence, so that they stop at different steps."""
    return {"max_new_tokens": (9, 14, 5, 11)[key % 4], "do_sample": key % 2 == 1, "temperature": 0.9,
            "seed": 100 + key, "eos_token_ids": (3, 17), "min_new_tokens": 2}


def outputs(case: str) -> dict:
    """{mode: {key: record}} for prompts prefilled apart at batch 1 and 4, and 4 forks of one prefill at batch 4."""
    import keydiff
    from keydiff import build_policy, prefill
    from tests.conftest import tiny_llama

    model = tiny_llama()
    name, params = CASES[case]

    def run(states: dict, batch_size: int) -> dict:
        requests = (keydiff.Request(state, key=key, **settings(key)) for key, state in states.items())
        done = {}
        for key, out in keydiff.generate_batch(model, requests, batch_size):
            done[str(key)] = {
                "tokens": out.token_ids[0], "finish": out.finish_reasons[0], "batch_sizes": out.batch_sizes,
                "kept": [p.tolist() for p in states[key].cache.kept_positions()],
                "kv_cache_bytes": out.kv_cache_bytes,
            }
        return dict(sorted(done.items()))

    def apart() -> dict:
        return {key: prefill(model, ids, build_policy(name, **params), BUDGET, BLOCK) for key, ids in enumerate(prompts())}

    with torch.no_grad():
        forks = prefill(model, prompts()[2], build_policy(name, **params), BUDGET, BLOCK).fork(4)
        return {"apart_batch1": run(apart(), 1), "apart_batch4": run(apart(), 4),
                "forks_batch4": run(dict(enumerate(forks)), 4)}


@pytest.mark.extended
@pytest.mark.parametrize("case", sorted(CASES))
def test_batched_decoding_gives_what_was_recorded(case):
    expected = json.loads(GOLDEN.read_text())[case]
    actual = outputs(case)
    for mode in expected:
        assert sorted(actual[mode]) == sorted(expected[mode]), (case, mode)
        for key, want in expected[mode].items():
            got = actual[mode][key]
            for field in ("tokens", "finish", "batch_sizes", "kv_cache_bytes"):
                assert got[field] == want[field], (case, mode, key, field)
            for layer, (a, b) in enumerate(zip(got["kept"], want["kept"], strict=True)):
                assert a == b, f"{case} {mode} sequence {key}: kept positions differ at layer {layer}"


def record() -> None:
    GOLDEN.parent.mkdir(exist_ok=True)
    lines = [f"{json.dumps(case)}: {json.dumps(outputs(case), sort_keys=True)}" for case in sorted(CASES)]
    GOLDEN.write_text("{\n" + ",\n".join(lines) + "\n}\n")  # one case per line
    print(f"recorded {len(CASES)} cases in {GOLDEN.relative_to(ROOT)}")


if __name__ == "__main__":
    if sys.argv[1:] != ["--record"]:
        sys.exit("usage: python -m tests.test_golden_batching --record")
    record()
