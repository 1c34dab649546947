"""keydiff.capture / keydiff.analysis on the tiny Llama: traces against what the engine keeps, statistics against
references, the paper's Table 3 beside ours, the entry points and their one-line errors."""

from __future__ import annotations

import json
import math
import shlex
from pathlib import Path

import pandas as pd
import pytest
import torch

from keydiff import prefill
from keydiff.analysis import common as analysis_common
from keydiff.analysis import figures, future_attention, table3
from keydiff.analysis.statistics import fit_pca, keydiff_score, log_volume, pairwise_cosine, project, scaled_heads
from keydiff.capture import capture_prompt, trace_eviction
from keydiff.bench import scoring
from tests.conftest import char_tokenizer, tiny_llama

pytestmark = pytest.mark.unit

POLICIES = ["sink", "tova", "keydiff", "h2o", "snapkv", "knorm"]


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 256, (1, 120), generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def captures(model, ids):
    return capture_prompt(model, ids, window=16)


@pytest.mark.integration
def test_capture_selected_layers_and_bad_input(model, ids):
    only = capture_prompt(model, ids, layers=[1])
    assert only[0] is None and only[2] is None and only[1].keys.shape == (2, 120, 16)
    with pytest.raises(ValueError, match="out of range"):
        capture_prompt(model, ids, layers=[3])
    with pytest.raises(ValueError, match="batch 1"):
        capture_prompt(model, ids.expand(2, -1))


@pytest.mark.integration
@pytest.mark.parametrize("policy", POLICIES)
def test_trace_retains_what_the_engine_keeps(model, ids, captures, policy):
    budget, block = 40, 16
    plain = prefill(model, ids, policy, budget, block)
    traces = trace_eviction(model, ids, policy, budget, block)
    for layer, trace in enumerate(traces):
        assert torch.equal(trace.retained_positions, plain.kept_positions[layer][0])
        assert trace.retained_keys.shape == (2, budget, 16) and trace.evicted_keys.shape == (2, 120 - budget, 16)
        every = torch.cat([trace.retained_positions, trace.evicted_positions], dim=1).sort(dim=-1).values
        assert torch.equal(every, torch.arange(120).expand(2, -1))  # disjoint and complete
    # Layer 0's keys do not depend on eviction: both sets are the full prompt's keys at their positions.
    first = traces[0]
    for keys, positions in ((first.retained_keys, first.retained_positions),
                            (first.evicted_keys, first.evicted_positions)):
        expected = captures[0].keys.gather(1, positions[..., None].expand(-1, -1, 16))
        torch.testing.assert_close(keys, expected, atol=1e-5, rtol=1e-5)


def test_log_volume_is_the_pseudo_determinant_and_stable():
    generator = torch.Generator().manual_seed(0)
    for n, d in ((50, 8), (5, 8)):
        keys = torch.randn(n, d, generator=generator, dtype=torch.float64)
        eigenvalues = torch.linalg.eigvalsh(keys @ keys.T)
        expected = eigenvalues[-min(n, d):].log().sum()  # the nonzero ones
        assert log_volume(keys).item() == pytest.approx(expected.item(), rel=1e-9)
        # Scaling K by s adds 2 min(n, d) log s, with no overflow at float32-hostile scales.
        for scale in (1e-6, 1e6):
            shifted = log_volume((keys * scale).float()).item()
            assert shifted == pytest.approx(expected.item() + 2 * min(n, d) * math.log(scale), rel=1e-5)
    keys = torch.randn(50, 8, generator=generator, dtype=torch.float64)
    ridged = torch.linalg.slogdet(keys @ keys.T + 1e-3 * torch.eye(50, dtype=torch.float64)).logabsdet
    assert log_volume(keys, ridge=1e-3).item() == pytest.approx(ridged.item(), rel=1e-9)
    # Rank 2 of 3: the determinant is 0 up to rounding, far below the full-rank volume (or -inf).
    full_rank = log_volume(keys[:3]).item()
    assert log_volume(torch.stack([keys[0], keys[0], keys[1]])).item() < full_rank - 20
    assert log_volume(torch.zeros(3, 8)).item() == -math.inf
    assert log_volume(torch.randn(3, 4, 50, 8)).shape == (3, 4)


def test_pca_and_keydiff_score():
    generator = torch.Generator().manual_seed(0)
    basis = torch.linalg.qr(torch.randn(16, 2, generator=generator)).Q.T  # a 2-D plane in 16-D
    coords = torch.randn(200, 2, generator=generator) * torch.tensor([3.0, 1.0])
    pca = fit_pca(coords @ basis + 5.0)
    torch.testing.assert_close(pca.components @ pca.components.T, torch.eye(2), atol=1e-5, rtol=0)
    assert pca.explained.sum().item() == pytest.approx(1.0, abs=1e-5)
    projected = project(coords @ basis + 5.0, pca)
    assert projected.var(dim=0)[0] > projected.var(dim=0)[1]
    keys = torch.randn(2, 30, 8, generator=generator)
    pairwise = -pairwise_cosine(keys).sum(dim=-1)
    assert torch.equal(keydiff_score(keys).argsort(dim=-1), pairwise.argsort(dim=-1))


def test_scaled_heads_follow_the_paper():
    assert scaled_heads(28, 8) == {"fig05": (5, 3), "fig08": (27, 4), "fig09": (20, 0), "fig10": (8, 1)}
    assert all(0 <= l < 3 and 0 <= h < 2 for l, h in scaled_heads(3, 2).values())


@pytest.fixture
def restore_threads():
    """--threads sets torch's thread count for the whole process: put it back after the test."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.mark.extended
def test_scoring_latency_tables_at_tiny_sizes(restore_threads, tmp_path):
    tiny = ["--shape", "tiny", "--repeats", "2", "--warmup", "1", "--block-size", "8", "--threads", "1",
            "--out", str(tmp_path / "tables"), "--figures", str(tmp_path / "figures")]
    paths = scoring.main(["table19", "--sizes", "48,96", *tiny])
    rows = pd.read_csv(paths[1])
    assert set(rows["policy"]) == {"snapkv", "tova", "keydiff", "h2o", "sink"} and set(rows["N"]) == {48, 96}
    assert rows[(rows["policy"] == "keydiff") & (rows["N"] == 48)]["relative"].item() == pytest.approx(1.0)
    assert (rows["median_s"] > 0).all() and (rows["peak_bytes"] > 0).all()
    assert "11.42" in paths[0].read_text()  # the paper's Android numbers beside ours
    paths = scoring.main(["table2", "--budgets", "48,96", "--blocks", "4,8", "--budget", "48",
                          "--policies", "keydiff,h2o", *tiny])
    assert all(p.exists() for p in paths) and paths[-1].suffix == ".png"
    data = json.loads(paths[2].read_text())
    assert len(data["results"]) == 2 * 2 * 2 and data["code"]["commit"]
    assert data["command"].startswith("python -m keydiff.bench.scoring table2") and data["started"] <= data["time"]
    with pytest.raises(SystemExit):
        scoring.main(["table19", "--policies", "snapkv", "--sizes", "16", *tiny])  # window 32 >= budget 16


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_llama")
    tiny_llama().save_pretrained(folder)
    char_tokenizer().save_pretrained(folder)
    return folder


def test_prompt_sources_ruler_s_essay_file_and_longbench(tmp_path):
    """RULER's PaulGrahamEssays.json is named by its file; LongBench prompts are the task's, middle-truncated."""
    from omegaconf import OmegaConf

    (tmp_path / "PaulGrahamEssays.json").write_text(json.dumps({"text": "An essay about startups. " * 20}))
    cfg = OmegaConf.create({"data": {"source": "haystack", "haystack_dir": str(tmp_path)}, "length": 32, "samples": 2})
    prompts, data = analysis_common.prompts(cfg, char_tokenizer(), "musique")
    assert len(prompts) == 2 and data["description"] == "RULER's PaulGrahamEssays.json"
    longbench = Path(__file__).resolve().parent.parent / "tasks" / "fixtures" / "longbench" / "data"
    cfg = OmegaConf.create({"data": {"source": "longbench", "dataset": None, "longbench_dir": str(longbench)},
                            "length": 80, "samples": 2})
    prompts, data = analysis_common.prompts(cfg, char_tokenizer(), "musique")  # table3's default data set
    assert [sid for sid, _ in prompts] == ["musique/0", "musique/1"] and data["dataset"] == "musique"
    assert any(key.endswith("musique.jsonl") for key in data["sources"])
    # The raw prompts hold > 2000 characters = tokens here; the char tokenizer's decode spaces tokens out, so the
    # re-encoded prompt is longer than 80.
    assert all(ids.numel() < 400 for _, ids in prompts)


@pytest.mark.integration
@pytest.mark.extended
def test_analysis_entry_points_end_to_end(tmp_path, tiny_checkpoint):
    prose = tmp_path / "haystack"
    prose.mkdir()
    (prose / "a.txt").write_text("The keys of a head mostly point one way; a few point elsewhere. " * 8)
    common = ["model=custom", f"model.path={tiny_checkpoint}", "model.dtype=float32", "model.device=cpu",
              f"data.haystack_dir={prose}",
              "length=96", "samples=2", "window=16", f"figures_dir={tmp_path / 'figures'}",
              f"tables_dir={tmp_path / 'tables'}", "formats=[png]"]
    table3.main(common)
    table = json.loads((tmp_path / "tables" / "table3_spearman.json").read_text())
    assert [row["layer"] for row in table["results"]["per_layer"]] == [1, 2, 3]
    assert all(row["n"] == 4 * 2 for row in table["results"]["per_layer"])  # 4 query heads x 2 prompts
    assert table["data"]["source"] == "haystack" and table["code"]["commit"] and table["model"]["source"] == "local"
    # The provenance record the benchmarks write too (keydiff.bench.common.provenance), plus the analysis' inputs.
    assert shlex.split(table["command"]) == ["python", "-m", "keydiff.analysis.table3", *common]
    assert table["started"] <= table["time"] and table["packages"]["torch"] == torch.__version__
    assert table["config"]["length"] == 96 and table["outputs"][-1].endswith("table3_spearman.json")
    figures.main(common + ["cache_budget=40", "block_size=16"])
    out = tmp_path / "figures"
    for name in ("fig02_key_cosine_attention", "fig04_pca_keys_queries", "fig11_pca_keys_queries", "fig12_logdet",
                 "fig13_cosine_to_mean", "fig14_mean_key_query_cosine", "fig15_norms", "fig16_top_key_mean_query"):
        assert (out / f"{name}.png").exists() and not (out / f"{name}.pdf").exists(), name
    assert len(list(out.glob("fig*_pca_retained_*.png"))) == 4
    summary = json.loads((out / "summary.json").read_text())
    assert {p: v["count"] for p, v in summary["results"]["fig12_logdet"].items()} == {
        "sink": 12, "tova": 12, "keydiff": 12}  # 3 layers x 2 KV heads x 2 prompts
    # Titles say what was measured; the prompt source is named without a path of this machine.
    source = "1 .txt file(s) of folder 'haystack'"
    assert summary["data"]["description"] == source and str(tmp_path) not in json.dumps(summary["results"]["titles"])
    titles = summary["results"]["titles"]
    assert titles["fig12_logdet"] == f"custom; {source}; 2 prompt(s) of 96 tokens; budget N = 40, B = 16"
    assert titles["fig13_cosine_to_mean"] == f"custom; {source}; 1 prompt(s) of 96 tokens"
    assert all("budget N = 40" in t for k, t in titles.items() if "_pca_retained_" in k)
    assert len(titles) == 8 + 4


@pytest.mark.extended
@pytest.mark.parametrize("override, message", [
    ("data.source=web", "data.source 'web' is not valid; valid: haystack, longbench"),
    ("cache_budget=4096", "must be smaller than length"),
    ("policies=[sink,nope]", "unknown policy 'nope'"),
    ("attention=max", "attention 'max' is not valid"),
])
def test_analysis_config_errors_before_loading(monkeypatch, override, message):
    cfg = analysis_common.load_config([override])
    pattern = message.replace("(", r"\(").replace("[", r"\[")
    with pytest.raises(ValueError, match=pattern):
        analysis_common.check_config(cfg, eviction=True)
    # The entry point stops with that message as one line, before loading any model.
    monkeypatch.setattr(figures, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    with pytest.raises(SystemExit, match="^error: .*" + pattern) as exit_info:
        figures.main([override])
    assert "\n" not in str(exit_info.value)


@pytest.mark.parametrize("arguments, message", [
    (["--policies", "keydiff,nope"], "unknown policies ['nope']; valid: "),
    (["--future", "0"], "--future must be between 1 and --context - 1"),
])
def test_future_attention_rejects_bad_input_before_loading(monkeypatch, capsys, arguments, message):
    monkeypatch.setattr(future_attention, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    with pytest.raises(SystemExit) as exit_info:
        future_attention.main(arguments)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_table3_shows_the_paper_beside_ours_with_a_caveat():
    """Table 3's Markdown: ours beside the paper's rho per layer, with a caveat when the models differ."""
    import csv

    from omegaconf import OmegaConf

    paper, (mean, std) = table3.paper_table3()
    stored = {r["column"]: float(r["value"]) for r in csv.DictReader(table3.PAPER_CSV.open())}
    assert paper == [stored[f"layer{i}"] for i in range(1, 25)] and (mean, std) == (stored["avg"], stored["std"])
    assert paper[0] == 0.8997 and paper[-1] == 0.8950  # layer 1 and layer 24 of the paper's table
    rhos = pd.DataFrame([{"sample": "s", "layer": layer, "head": head, "rho": 0.01 * layer + 0.001 * head}
                         for layer in range(1, 31) for head in range(3)])  # 30 layers, as SmolLM2-135M
    per_layer, per_head, overall = table3.summarize(rhos)
    cfg = OmegaConf.create({"model": {"name": "smollm2-135m"}, "length": 2048, "anchor": "mean",
                            "attention": "mean_received"})
    data = {"source": "longbench", "dataset": "musique", "samples": ["musique/0"]}
    text = table3.markdown(cfg, per_layer, per_head, overall, data)
    layers = text.split("Per query head")[0]
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.strip("|").split("|")]
            for line in layers.splitlines() if line.startswith("| ") and not line.startswith("| layer")}
    assert rows["1"] == ["1", "0.0110 +- 0.0008", "3", "0.8997"]  # ours and the paper's layer 1 on one row
    assert rows["24"][-1] == "0.8950" and rows["30"][-1] == "--"  # past the paper's 24 columns: ours alone
    assert rows["mean of layers"][-1] == "0.94 +- 0.02"
    assert "Caveat: different models and settings. Ours: smollm2-135m" in text
    assert "Llama-3.2-3B-Instruct, LongBench MuSiQue" in text and "| rho, paper (llama-3.2-3b-instruct) |" in text
    same = table3.markdown(OmegaConf.merge(cfg, {"model": {"name": "llama-3.2-3b-instruct"}}), per_layer, per_head,
                           overall, data)
    assert "Caveat: different models" not in same and "Same model as the paper" in same


@pytest.mark.integration
def test_capture_matches_eager_weights_and_cache_keys(model, ids, captures):
    eager = tiny_llama("eager")
    with torch.no_grad():
        out = eager(ids, output_attentions=True, use_cache=True)
    for layer, capture in enumerate(captures):
        weights = out.attentions[layer][0]  # [H, L, L]
        assert capture.keys.shape == (2, 120, 16) and capture.queries.shape == (4, 120, 16)
        torch.testing.assert_close(capture.keys, out.cache.layers[layer].keys[0])
        torch.testing.assert_close(capture.received_sum, weights.sum(dim=1), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(capture.received_mean, weights.sum(dim=1) / torch.arange(120, 0, -1), atol=1e-6,
                                   rtol=1e-5)
        torch.testing.assert_close(capture.last_row, weights[:, -1], atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(capture.window_weights, weights[:, :16, :16], atol=1e-6, rtol=1e-5)
        # Queries are the post-RoPE ones attention uses: they rebuild the weights with the keys.
        keys = capture.keys.repeat_interleave(capture.group, dim=0)
        logits = capture.queries @ keys.transpose(-1, -2) / 4.0
        rebuilt = logits.masked_fill(~torch.ones(120, 120, dtype=torch.bool).tril(), -math.inf).softmax(-1)
        torch.testing.assert_close(rebuilt, weights, atol=1e-5, rtol=1e-4)
