"""`python -m keydiff.bench peers` without kvpress: the comparison arithmetic, the runner's kvpress-free parts, our
side on a tiny model, the JSON and table output (real runs need `.venv-kvpress`)."""

from __future__ import annotations

import contextlib
import json
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from keydiff import build_policy, prefill
from keydiff.bench import common, peers, peers_runner


pytestmark = pytest.mark.unit


def test_compare_summarises_layers_and_rejects_mismatched_shapes():
    ours = [[[0, 1]], [[0, 1]], [[0, 1]]]
    theirs = [[[0, 1]], [[0, 5]], [[7, 8]]]
    result = peers.compare(ours, theirs)
    assert result["per_layer"] == [1.0, 0.5, 0.0]
    assert result["mean_overlap"] == pytest.approx(0.5)
    assert result["min_layer_overlap"] == 0 and result["min_head_overlap"] == 0
    assert not result["identical"]
    assert peers.compare(ours, ours)["identical"]
    with pytest.raises(ValueError, match="layers"):
        peers.compare(ours, theirs[:2])
    with pytest.raises(ValueError, match="KV heads"):
        peers.overlap([[0], [1]], [[0]])


@pytest.mark.parametrize("length,budget", [(512, 128), (7, 7), (999, 1)])  # exact, r = 0, r nudged by ulps
def test_compression_ratio_keeps_exactly_the_budget_the_kvpress_way(length, budget):
    ratio = peers_runner.compression_ratio_for(length, budget)
    assert 0 <= ratio < 1
    assert int(length * (1 - ratio)) == budget  # kvpress: n_kept = int(k_len * (1 - compression_ratio))


@pytest.mark.parametrize("ratio,length,budget", [
    (0.25, 4096, 1024), (0.254, 100, 26), (1e-9, 512, 1)])  # exact; rounded up (floor, round: 25); never zero
def test_parity_ratio_gives_ceil_of_ratio_times_length_as_the_runners_ratio_budgets(ratio, length, budget):
    assert peers.ratio_budget(ratio, length) == budget


def test_compression_ratio_rejects_budgets_outside_the_prompt():
    for budget in (0, 513):
        with pytest.raises(ValueError, match="budget"):
            peers_runner.compression_ratio_for(512, budget)


def test_pairs_set_our_parameters_to_kvpress_defaults_and_missing_presets_are_not_available():
    snapkv = next(p for p in peers.PAIRS if p.press == "snapkv")
    assert peers.our_policy(snapkv) == ("snapkv", {"window": 64, "kernel_size": 5, "pooling": "avg"})
    tova = next(p for p in peers.PAIRS if p.press == "tova")
    assert peers.our_policy(tova) == ("tova", {"heads": "layer"})
    assert peers.our_policy(peers.Pair("x", "no_such_preset", "keydiff")) is None


@pytest.mark.extended
def test_every_pair_has_its_preset_and_builds_and_a_pyramid_below_the_window_is_reported(tmp_path):
    for pair in peers.PAIRS:
        policy = peers.our_policy(pair)
        assert policy is not None, f"{pair.label}: conf/policy/{pair.ours}.yaml is missing"  # docs/peers.md
        build_policy(policy[0], **policy[1])
    pyramid = peers.our_policy(next(p for p in peers.PAIRS if p.press == "pyramidkv"))
    assert "window" in peers.budget_problem(pyramid, 128)
    assert peers.budget_problem(pyramid, 2048) is None
    assert peers.budget_problem(("keydiff", {}), 128) is None


def test_match_rows_finds_gathered_rows_and_refuses_duplicates():
    full = torch.randn(50, 8)
    index = torch.tensor([31, 2, 17, 40])
    assert peers_runner.match_rows(full, full[index]) == [2, 17, 31, 40]
    full[5] = full[9]
    with pytest.raises(ValueError, match="bitwise equal"):
        peers_runner.match_rows(full, full[:3])


def test_recorder_reads_pruned_and_masked_caches():
    keys = torch.randn(1, 2, 10, 4)
    cache, module = SimpleNamespace(layers=[SimpleNamespace(keys=keys)]), SimpleNamespace(layer_idx=0)
    recorder = peers_runner.KeptRecorder([module])
    recorder.before(module, (), {"past_key_values": cache}, None)
    cache.layers[0].keys = keys[:, :, [9, 0, 4]]  # a pruning press (score order, not sorted)
    recorder.after(module, (), {"past_key_values": cache}, None)
    assert recorder.kept[0] == [[0, 4, 9], [0, 4, 9]]

    cache = SimpleNamespace(layers=[SimpleNamespace(keys=keys)])
    recorder.before(module, (), {"past_key_values": cache}, None)
    # a masking press (AdaKV): head 0 loses 8 entries, head 1 loses 2; batch row 1's mask is not ours
    heads = torch.tensor([0] * 8 + [1] * 2 + [1])
    seqs = torch.tensor([1, 2, 3, 4, 5, 6, 7, 8, 0, 9, 5])
    batch = torch.tensor([0] * 10 + [1])
    module.masked_key_indices = (batch, heads, seqs)
    recorder.after(module, (), {"past_key_values": cache}, None)
    assert recorder.kept[0] == [[0, 9], [1, 2, 3, 4, 5, 6, 7, 8]]
    assert module.masked_key_indices is None


@pytest.fixture(scope="module")
def tiny_weights(tmp_path_factory):
    return peers.model_dir("tiny", "float32", 0, tmp_path_factory.mktemp("peers-weights"))


def spec(weights: Path, tmp_path: Path, length: int, **fields) -> dict:
    prompt = tmp_path / "prompt.json"
    peers.write_prompt(prompt, length, common.TINY["vocab_size"], seed=0)
    return {"side": "keydiff", "model_dir": str(weights), "dtype": "float32", "device": "cpu", "threads": 1,
            "prompt_file": str(prompt), **fields}


def reference_kept(model, ids: torch.Tensor, budget: int) -> list[list[list[int]]]:
    """One-pass KeyDiff computed without keydiff: per KV head, the N keys least similar to the mean unit key (Eq. 8)."""
    from transformers import DynamicCache

    cache = DynamicCache()
    with torch.no_grad():
        model(input_ids=ids, cache=cache, use_cache=True)
    kept = []
    for layer in cache.layers:
        keys = layer.keys[0].double()  # [kv_heads, L, d]
        unit = torch.nn.functional.normalize(keys, dim=-1)
        score = -torch.nn.functional.cosine_similarity(keys, unit.mean(dim=1, keepdim=True), dim=-1)
        kept.append([sorted(head.topk(budget).indices.tolist()) for head in score])
    return kept


@pytest.mark.integration
def test_our_parity_side_keeps_what_keydiff_keeps_over_the_whole_prompt_in_one_pass(tiny_weights, tmp_path):
    """Our parity side is kvpress's one-pass setting: the kept positions are an independent ranking's."""
    assert peers.model_dir("tiny", "float32", 0, tiny_weights.parent) == tiny_weights  # built once, then reused
    out = peers_runner.run(spec(tiny_weights, tmp_path, 64, mode="parity", budget=16, policy="keydiff", params={}))
    model = peers_runner.load_model({"model_dir": str(tiny_weights), "dtype": "float32", "device": "cpu"})
    ids = torch.tensor([json.loads((tmp_path / "prompt.json").read_text())])
    assert out["kept"] == reference_kept(model, ids, 16)
    assert len(out["kept"]) == common.TINY["num_hidden_layers"]
    assert len(out["logits_check"]) == 8 and all(math.isfinite(x) for x in out["logits_check"])
    blockwise = prefill(model, ids, "keydiff", 16, 16)  # the reference tells one pass from block-wise eviction
    assert [[sorted(h.tolist()) for h in layer[0]] for layer in blockwise.kept_positions] != out["kept"]


@pytest.mark.integration
@pytest.mark.extended
def test_our_perf_side_times_prefill_and_decode_and_reports_a_peak(tiny_weights, tmp_path):
    out = peers_runner.run(spec(tiny_weights, tmp_path, 96, mode="perf", budget=32, block_size=16, new_tokens=4,
                                warmup_tokens=40))
    assert out["ttft_s"] > 0 and out["decode_s"] > 0
    assert out["per_token_s"] == pytest.approx(out["decode_s"] / 3)
    assert out["cache_entries"] <= 32 + 16
    assert out["peak_bytes"] > 0 and out["peak_kind"] == "vmhwm"


class NoPress:
    """Stands in for a kvpress press: `with press(model):` changes nothing."""

    def __call__(self, model):
        return contextlib.nullcontext()


@pytest.mark.integration
def test_the_kvpress_perf_side_calls_the_model_the_pipeline_way_or_the_readme_way(tiny_weights, tmp_path, monkeypatch):
    monkeypatch.setattr(peers_runner, "build_press", lambda name, ratio: NoPress())
    model = peers_runner.load_model({"model_dir": str(tiny_weights), "dtype": "float32", "device": "cpu"})
    ids = torch.randint(0, common.TINY["vocab_size"], (1, 48), generator=torch.Generator().manual_seed(0))
    base = {"device": "cpu", "budget": 16, "new_tokens": 5}
    pipeline = peers_runner.kvpress_generate(model, ids, {**base, "kvpress_call": "pipeline"})
    readme = peers_runner.kvpress_generate(model, ids, {**base, "kvpress_call": "readme"})
    vocab = model.config.vocab_size
    assert pipeline["prompt_logits_shape"] == [1, 1, vocab]  # logits_to_keep=1: no [L, vocab] tensor
    assert readme["prompt_logits_shape"] == [1, 48, vocab]  # the README call: every prompt position
    assert (pipeline["kvpress_call"], readme["kvpress_call"]) == ("pipeline", "readme")
    assert pipeline["cache_entries"] == readme["cache_entries"] == 48  # the stand-in press prunes nothing
    # the same last-position logits, the same decoding (logits_to_keep=1, explicit positions) after either call
    assert len(pipeline["tokens"]) == 5 and readme["tokens"] == pipeline["tokens"]
    assert peers_runner.kvpress_generate(model, ids, base)["kvpress_call"] == "pipeline"  # the default
    with pytest.raises(ValueError, match="valid: pipeline, readme"):
        peers_runner.kvpress_generate(model, ids, {**base, "kvpress_call": "full"})


def perf_payload(by_length: dict[int, dict[str, tuple[float, float, float]]], threads: int = 2, kind: str = "vmhwm"):
    """The parts of a perf JSON that `tables` reads: per L and case, one run (TTFT s, s/token, GB)."""
    samples = {str(L): {case: [{"ttft_s": t, "per_token_s": s, "peak_bytes": gb * 1e9, "peak_kind": kind}]
                        for case, (t, s, gb) in cases.items()} for L, cases in by_length.items()}
    return {"shape": "smollm2-135m", "device": "cpu", "threads": threads, "dtype": "float32", "seed": 0,
            "perf": {"budget": 1024, "block_size": 128, "new_tokens": 16, "samples": samples,
                     "medians": {L: peers.summarize_perf(cases) for L, cases in samples.items()}}}


@pytest.mark.extended
def test_the_doc_tables_are_rendered_from_the_json_files_and_refuse_mixed_settings(tmp_path, capsys):
    four = {"kvpress_keydiff": (10.0, 0.060, 1.2), "kvpress_keydiff_full_logits": (11.0, 0.062, 2.4),
            "keydiff_blockwise": (12.0, 0.066, 0.96), "keydiff_one_block": (9.0, 0.063, 1.32)}
    long = {"kvpress_keydiff": (300.0, 0.068, 3.0), "kvpress_keydiff_full_logits": (330.0, 0.062, 8.0),
            "keydiff_blockwise": (100.0, 0.068, 1.0), "keydiff_one_block": (310.0, 0.070, 3.3)}
    doc, readme = peers.doc_tables([perf_payload({32768: long}), perf_payload({4096: four})])
    lines = doc.splitlines()
    assert lines[2].startswith("| 4096 | kvpress KeyDiffPress, pipeline call |")  # sorted by L, whatever the file order
    assert "| 4096 | ours block-wise, B = 128 | last | 12.00 | 66.0 | 0.96 | 1.20 | 1.10 | 0.80 | 0.40 |" in lines
    assert "| 32768 | kvpress KeyDiffPress, README call | all L | 330.00 | 62.0 | 8.00 | 1.10 | 0.91 | 2.67 | 1.00 |" in lines
    assert doc.endswith("peak kinds: vmhwm")
    assert "| 32,768 | 300.0 → 100.0 s | 0.33 | 3.00 / 8.00 → 1.00 GB | 0.33 / 0.12 | 68.0 → 68.0 |" in readme
    with pytest.raises(ValueError, match="different settings"):
        peers.doc_tables([perf_payload({32768: long}, threads=1), perf_payload({4096: four})])
    with pytest.raises(ValueError, match="more than one file"):
        peers.doc_tables([perf_payload({4096: four}), perf_payload({4096: four})])
    assert peers.doc_tables([perf_payload({4096: four}, kind="peak_rss")])[0].endswith("peak kinds: peak_rss")
    path = tmp_path / "perf.json"
    path.write_text(json.dumps(perf_payload({4096: four})))
    peers.main(["tables", str(path)])
    printed = capsys.readouterr().out
    assert "| 4,096 | 10.0 → 12.0 s | 1.20 |" in printed
    assert "L=4096: ours block-wise 2.93 ms per prompt token; over kvpress_keydiff: TTFT 1.20, peak 0.80; " \
           "over kvpress_keydiff_full_logits: TTFT 1.09, peak 0.40" in printed


def fake_child(side, spec, work, kvpress_python):
    """kvpress keeps 0..N-1, ours 1..N; perf costs: pipeline 2, README 3, ours 1; logits differ by 0.25, 0.125."""
    shift = 1 if side == "keydiff" else 0
    n = spec["budget"]
    if spec["mode"] == "perf":
        scale = {"pipeline": 2.0, "readme": 3.0}[spec["kvpress_call"]] if side == "kvpress" else 1.0
        return {"logits_check": [0.0, 0.125 * shift], "ttft_s": scale, "decode_s": scale, "per_token_s": scale / 10,
                "peak_bytes": scale * 1e9}
    kept = [[list(range(shift, n + shift))] * 3] * 2
    return {"logits_check": [0.5] * 7 + [0.5 - 0.25 * shift], "kept": kept, "compression_ratio": 0.75, "press_repr": "P()",
            "policy_repr": "Q()"}


@pytest.mark.slow
def test_main_writes_every_value_with_provenance_and_never_overwrites(tmp_path, monkeypatch, capsys):
    env = tmp_path / "env"
    env.mkdir()
    (env / "complete-marker").write_text("{}")
    monkeypatch.setattr(peers.peers_env, "build", lambda *a, **k: Path(sys.executable))
    monkeypatch.setattr(peers.peers_env, "MARKER", "complete-marker")
    monkeypatch.setattr(peers, "run_child", fake_child)
    monkeypatch.setattr(peers, "model_dir", lambda *a: tmp_path)
    out = tmp_path / "peers.json"
    peers.main(["all", "--pairs", "keydiff", "--length", "40", "--budget", "8", "--lengths", "64", "--rounds", "2",
                "--env", str(env), "--json", str(out)])
    printed = capsys.readouterr().out
    assert "| keydiff | keydiff | keydiff | 0.875 | 0.875 | 0.875 | no | 48 / 48 |" in printed
    assert "max |ours - kvpress| = 0.25\n" in printed and "max |ours - kvpress| = 0.125\n" in printed
    record = json.loads(out.read_text())
    assert record["parity"]["rows"][0]["comparison"]["mean_overlap"] == pytest.approx(7 / 8)
    assert record["parity"]["rows"][0]["logits_max_abs_diff"] == 0.25
    assert record["perf"]["ratios"]["64"]["keydiff_blockwise"]["ttft_s"] == pytest.approx(0.5)
    assert record["perf"]["ratios"]["64"]["kvpress_keydiff_full_logits"]["peak_bytes"] == pytest.approx(1.5)
    assert record["perf"]["cases"] == list(peers.PERF_CASES)
    assert {case: len(runs) for case, runs in record["perf"]["samples"]["64"].items()} == dict.fromkeys(
        peers.PERF_CASES, 2)  # every round of every case
    assert "| 64 | kvpress_keydiff_full_logits | all L | 3.00 |" in printed
    assert record["command"].startswith("python -m keydiff.bench.peers") and "code" in record
    assert record["parity_data"]["tokens"] == 40 and len(record["perf_data"][0]["sha256"]) == 64
    before = out.read_text()
    with pytest.raises(SystemExit):
        peers.main(["parity", "--pairs", "keydiff", "--env", str(env), "--json", str(out)])
    assert out.read_text() == before


def test_the_kvpress_environment_is_reused_when_complete_and_never_the_projects_own(tmp_path, monkeypatch):
    from keydiff.bench import peers_env

    env = tmp_path / "venv-kvpress"
    (env / "bin").mkdir(parents=True)
    (env / "bin" / "python").write_text("")
    assert not peers_env.is_complete(env)  # no marker: an interrupted build, to be redone
    (env / peers_env.MARKER).write_text('{"kvpress": "0.5.5"}\n')
    assert peers_env.is_complete(env)
    monkeypatch.setattr(peers_env, "pip", lambda *a: pytest.fail("a complete environment is not reinstalled"))
    assert peers_env.build(env) == env / "bin" / "python"
    other = tmp_path / "data"
    other.mkdir()
    (other / "keep.txt").write_text("x")
    with pytest.raises(SystemExit, match="not a virtual environment"):
        peers_env.build(other)  # an incomplete folder is rebuilt only if it is a venv
    assert (other / "keep.txt").read_text() == "x"
    with pytest.raises(SystemExit, match="project's own environment"):
        peers_env.build(peers_env.CHECKOUT / ".venv")
    with pytest.raises(SystemExit, match="project's own environment"):
        peers_env.build(Path(sys.prefix))
