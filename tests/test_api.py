"""The "Python API" page (docs/api.md, linked from the README) is a runnable example: its python blocks are
executed verbatim, in order, with the real offline default model, and what their comments claim is checked."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]


def api_blocks() -> list[str]:
    """The ```python blocks of docs/api.md, in order."""
    text = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


@pytest.mark.real_model
def test_the_api_page_runs_as_written(capsys):
    blocks = api_blocks()
    assert len(blocks) == 5 and "keydiff.load_model(" in blocks[0]
    namespace: dict = {}
    exec(compile(blocks[0], "docs/api.md: block 1", "exec"), namespace)
    first = capsys.readouterr().out
    prompt_length = namespace["input_ids"].shape[1]
    assert prompt_length == 346 and "L = 346 tokens" in blocks[0]
    kept = namespace["state"].kept_positions
    assert len(kept) == 30 and all(positions.shape[-1] == 128 for positions in kept)  # the budget, every layer
    out = namespace["out"]
    assert isinstance(out.token_ids, list) and isinstance(out.token_ids[0], list) and not hasattr(out, "sequences")
    assert 0 < len(out.token_ids[0]) <= 16
    cache = namespace["state"].cache
    assert cache.get_seq_length() == prompt_length + len(out.token_ids[0]) - 1  # seen: prompt + fed tokens
    assert cache.entries_held() <= 128 + 1 and cache.entries_held(29) <= 128 + 1  # held: the budget (+1 between steps)
    assert "4721" in first  # the printed answer the comment shows

    exec(compile(blocks[1], "docs/api.md: block 2", "exec"), namespace)
    assert namespace["tokens"] == out.token_ids[0][:8]  # the loop gives keydiff.generate's tokens
    assert namespace["state"].cache.entries_held() <= 128 + 1

    exec(compile(blocks[2], "docs/api.md: block 3", "exec"), namespace)  # fork + generate_batch
    import keydiff

    model, samples = namespace["model"], namespace["samples"]
    assert sorted(samples) == [0, 1, 2] and samples[0].batch_sizes[0] == 3
    for seed in range(3):
        fresh = keydiff.prefill(model, namespace["input_ids"], namespace["policy"], budget=128, block_size=64)
        alone = keydiff.generate(model, fresh, max_new_tokens=8, do_sample=True, temperature=0.7, seed=seed)
        assert samples[seed].token_ids == alone.token_ids

    exec(compile(blocks[3], "docs/api.md: block 4", "exec"), namespace)  # a run's Decoder across calls
    for n, answer in zip((300, 346), namespace["answers"]):
        fresh = keydiff.prefill(model, namespace["input_ids"][:, :n], namespace["policy"], budget=128, block_size=64)
        assert answer == keydiff.generate(model, fresh, max_new_tokens=8).token_ids[0]
    assert namespace["decoder"].widths == [2]

    exec(compile(blocks[4], "docs/api.md: block 5", "exec"), namespace)  # held_suffix
    held, state = namespace["held"], namespace["state"]
    length = namespace["context_ids"].shape[1] + held
    assert 5 < held < 30 and state.held_suffix == held
    for positions in state.kept_positions:  # the context's 128 and the whole question, every layer and head
        assert positions.shape[-1] == 128 + held and (positions[..., -held:] == torch.arange(length - held, length)).all()
    generated = len(namespace["out"].token_ids[0])
    assert state.cache.entries_held() == 128 + held + generated - 1  # evict=False: nothing dropped since


def test_load_model_accepts_a_name_a_hub_id_or_a_folder(tmp_path):
    from keydiff.models import ModelConfig, model_config

    assert model_config("smollm2-135m") == ModelConfig()
    hub = model_config("meta-llama/Llama-3.1-8B-Instruct", dtype="bfloat16")
    assert (hub.name, hub.path, hub.dtype, hub.is_hub_id) == ("Llama-3.1-8B-Instruct", "meta-llama/Llama-3.1-8B-Instruct",
                                                              "bfloat16", True)
    folder = model_config(str(tmp_path) + "/", device="cpu")
    assert folder.name == tmp_path.name and not folder.is_hub_id and folder.device == "cpu"
    with pytest.raises(ValueError, match="unknown model setting.*'precision'.*valid: name, path, dtype"):
        model_config("smollm2-135m", precision="bf16")
