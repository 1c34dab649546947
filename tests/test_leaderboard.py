"""experiment=leaderboard: the kvpress-shaped grid, the qwen3-8b config, and the leaderboard table and figure."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from keydiff.paper import registry
from keydiff.report import figures, leaderboard
from keydiff.report.ruler import TASKS

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
RATIOS = ["r0.125", "r0.25", "r0.5", "r0.75"]


def compose(overrides):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    import keydiff  # noqa: F401  resolvers
    from tests.test_runner import OUTSIDE_RESULTS

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return hydra_compose("config", overrides=[OUTSIDE_RESULTS, *overrides], return_hydra_config=True)


@pytest.mark.extended
@pytest.mark.parametrize("name, query_aware", [("leaderboard", False), ("leaderboard_full", False),
                                               ("leaderboard_query_aware", True)])
def test_leaderboard_experiments_run_ruler_4k_the_kvpress_way(name, query_aware):
    """leaderboard.sh: the query-agnostic methods query-agnostic, the query-aware loop with --query_aware."""
    cfg = compose([f"experiment={name}"])
    assert cfg.experiment_name == name and cfg.task.name == "ruler_4k" and cfg.task.answer_prefix_style == "kvpress"
    assert cfg.query_aware is query_aware


@pytest.mark.extended
def test_leaderboard_protocols_and_ratio_budgets():
    for protocol, block, decode in (("kvpress", "inf", False), ("bounded", 128, True)):
        job = compose(["experiment=leaderboard", f"protocol={protocol}"])
        assert (str(job.block_size), job.decode_eviction) == (str(block), decode)
    for budget in RATIOS:  # each kept ratio's kvpress compression ratio is 1 - kept
        ratio = compose([f"budget={budget}"]).budget
        assert ratio.tokens is None and ratio.label == budget and f"r = {1 - ratio.ratio:g})" in \
            (CONF / "budget" / f"{budget}.yaml").read_text()
    assert compose(["experiment=leaderboard_full"]).budget.label == "unbounded"
    assert registry.TABLES["leaderboard"].reads == ("leaderboard", "leaderboard_query_aware", "leaderboard_full")


@pytest.mark.extended
def test_a_leaderboard_grid_with_a_subset_of_policies_composes_and_passes_the_checks():
    """Policies given on the command line: every point composes, passes check_run_config, has its own directory."""
    from hydra import initialize_config_dir

    from keydiff.run.checks import check_run_config
    from keydiff.run.sweep import grid_points

    cfg = compose(["experiment=leaderboard"])
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        points = grid_points(dict(cfg.hydra.sweeper.params), ["model=smollm2-135m", "policy=keydiff,tova",
                                                              "task.data_dir=tasks/fixtures/ruler", "task.limit=1"])
    assert len(points) == 16
    dirs = set()
    for point in points:
        job = compose(["experiment=leaderboard", *point])
        check_run_config(job)
        dirs.add(job.run_subdir)
    assert dirs == {f"ruler_4k/smollm2-135m/{p}/{b}/{bs}-query-agnostic/seed0-limit1" for p in ("keydiff", "tova")
                    for b in RATIOS for bs in ("bs128", "bsinf")}


@pytest.mark.extended
def test_qwen3_8b_config_is_the_kvpress_leaderboard_model():
    from keydiff.models import ModelConfig

    cfg = compose(["model=qwen3-8b"])
    model = ModelConfig.from_dict(cfg.model)  # every key is a ModelConfig field
    assert (model.name, model.path, model.dtype, model.attn_implementation) == ("qwen3-8b", "Qwen/Qwen3-8B", "bfloat16", "sdpa")
    assert model.is_hub_id and not model.trust_remote_code and model.max_length <= 32768
    assert compose(["experiment=leaderboard", "model=qwen3-8b"]).model.name == "qwen3-8b"
    from transformers import Qwen3Config  # transformers knows the architecture without remote code

    assert Qwen3Config().max_position_embeddings >= model.max_length


def test_ruler_renders_a_thinking_template_without_thinking():
    """RULER passes enable_thinking=False (an empty think block); other templates render as before."""
    from keydiff.tasks.ruler import Ruler

    class Tokenizer:
        def __init__(self, template):
            self.chat_template = template

        def apply_chat_template(self, messages, tokenize, add_generation_prompt, **kwargs):
            from jinja2 import Template

            return Template(self.chat_template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                                       **kwargs)

        def __call__(self, text, add_special_tokens=True):
            return {"input_ids": [ord(c) for c in text]}

    thinking = ("<u>{{ messages[0].content }}</u><a>{% if enable_thinking is defined and enable_thinking is false %}"
                "<think>\n\n</think>\n\n{% endif %}")
    _, rendered, _ = Ruler(tasks=["vt"]).encode(Tokenizer(thinking), "question", " Answer:")
    assert rendered == "<u>question</u><a><think>\n\n</think>\n\n Answer:"
    _, plain, _ = Ruler(tasks=["vt"]).encode(Tokenizer("<u>{{ messages[0].content }}</u><a>"), "question", " Answer:")
    assert plain == "<u>question</u><a> Answer:"


def run(policy, budget, score, se, experiment="leaderboard", samples=5, limit=np.nan, tasks=len(TASKS), model="m",
        block="128", task="ruler_4k", complete=True, query_aware=False, decode_eviction=True):
    row = {"experiment": experiment, "task": task, "model": model, "policy": policy,
           "policy_name": "full" if policy == "full" else policy, "budget_label": "unbounded" if policy == "full" else budget,
           "block_size": block, "seed": 0, "limit": limit, "complete": complete, "samples": samples * tasks,
           "num_failed": 0, "score": score, "se/score": se, "query_aware": query_aware,
           "decode_eviction": decode_eviction}  # samples: rows scored over all tasks, as collect's
    row.update({f"metrics/tasks/{t}": score if i < tasks else np.nan for i, t in enumerate(TASKS)})
    row.update({f"metrics/n/{t}": samples if i < tasks else np.nan for i, t in enumerate(TASKS)})
    return row


BOUNDED = "bounded (B=128, decode eviction)"
SCORES = {"keydiff": [40.0, 55.0, 70.0, 80.0], "tova": [30.0, 60.0, 65.0, 85.0]}  # kept 0.125, 0.25, 0.5, 0.75


@pytest.fixture
def summary():
    rows = [run(p, b, s, 1.0 + i) for p, scores in SCORES.items() for i, (b, s) in
            enumerate(zip(RATIOS[::-1], scores[::-1]))]  # written in reverse ratio order
    rows = [dict(r, score=SCORES[r["policy"]][RATIOS.index(r["budget_label"])],
                 **{"se/score": 1.0 + RATIOS.index(r["budget_label"])}) for r in rows]
    rows += [run("sink", "r0.5", 50.0, 2.0, tasks=11),          # one ratio only: no average, ranked last
             run("full", None, 90.0, 0.5, experiment="leaderboard_full"),
             run("keydiff", "2k", 99.0, 0.1),                  # a token budget: not on the leaderboard
             run("keydiff", "r0.5", 1.0, 0.1, experiment="ruler"),  # another experiment
             run("snapkv", "r0.5", 45.0, 3.0, limit=1, samples=1)]  # a subset run, marked
    frame = pd.DataFrame(rows)
    frame["se/score"] = frame["se/score"].where(frame["metrics/n/vt"] > 1)  # one sample per task: no interval
    return frame


@pytest.mark.extended
def test_leaderboard_table_orders_ratios_ranks_methods_and_puts_full_first(summary, tmp_path):
    table = registry.TABLES["leaderboard"]
    assert leaderboard.write(summary, tmp_path, table)
    scores, text = leaderboard.layout(leaderboard.runs(summary, table))
    assert list(scores.columns) == ["0.125 (r=0.875)", "0.25 (r=0.75)", "0.5 (r=0.5)", "0.75 (r=0.25)", "Avg.", "1 (r=0)"]
    methods = list(scores.index.get_level_values("Method"))
    assert methods == ["Full", "KeyDiff", "TOVA", "Sink", "SnapKV"]  # full, by Avg. (61.25 > 60), then by name
    assert scores.loc[("ruler_4k", "m", BOUNDED, "KeyDiff")].tolist()[:5] == [40.0, 55.0, 70.0, 80.0, 61.25]
    assert scores.loc[("ruler_4k", "m", BOUNDED, "Full"), "1 (r=0)"] == 90.0
    keydiff = text.loc[("ruler_4k", "m", BOUNDED, "KeyDiff")]
    # Wilson inside 0-100 at n_eff = p(1 - p) / SE^2: close to 40 ± 1.96 away from the bounds, n per task shown
    assert keydiff["0.125 (r=0.875)"] == "40.00 [38.06, 41.97] (n=5)" and keydiff["1 (r=0)"] == "--"
    assert keydiff["0.75 (r=0.25)"] == "80.00 [71.12, 86.66] (n=5)"  # asymmetric near the top of the range
    assert keydiff["Avg."] == "61.25 [56.26, 66.01]"  # from the mean of the ratios' SEs (same samples)
    # one sample per task, 13 behind the average, no SE: the widest-spread (0/1) interval over 13 samples
    assert text.loc[("ruler_4k", "m", BOUNDED, "SnapKV"), "0.5 (r=0.5)"] == "45.00 [22.35, 69.93] (n=1)§"
    assert text.loc[("ruler_4k", "m", BOUNDED, "Sink"), "0.5 (r=0.5)"].endswith(" (11/13)")
    assert text.loc[("ruler_4k", "m", BOUNDED, "Sink"), "Avg."] == "--"
    md = (tmp_path / "leaderboard.md").read_text()
    assert "**70.00 [" in md and "**90.00" not in md  # best per column bold; the full cache never
    assert f"| ruler_4k | m | {BOUNDED} | TOVA | 30.00 [" in md and "kvpress" in md
    assert r"\toprule" in (tmp_path / "leaderboard.tex").read_text()
    csv = pd.read_csv(tmp_path / "leaderboard.csv")
    assert len(csv) == 11 and set(csv["budget"]) == {*RATIOS, "--"}
    assert np.allclose(csv["kvpress_compression_ratio"], 1 - csv["kept_ratio"])
    assert csv.loc[csv["policy"] == "full", "kept_ratio"].tolist() == [1.0]
    assert ((0 <= csv["ci95_low"]) & (csv["ci95_low"] <= csv["ruler_average"]) & (csv["ruler_average"] <= csv["ci95_high"])
            & (csv["ci95_high"] <= 100)).all()  # every run has one (>= 13 samples), inside the range, around the score
    assert csv.loc[csv["policy"] == "keydiff", "samples_per_task"].tolist() == [5] * 4  # n per task, not 65 rows
    assert csv.loc[csv["policy"] == "keydiff", "samples"].tolist() == [65] * 4


def test_leaderboard_table_waits_for_runs(tmp_path):
    other = pd.DataFrame([run("keydiff", "r0.5", 50.0, 1.0, experiment="ruler")])
    assert not leaderboard.write(other, tmp_path, registry.TABLES["leaderboard"])
    assert not (tmp_path / "leaderboard.md").exists()


@pytest.fixture
def drawn(monkeypatch):
    """The figures figures.save is given, in order."""
    saved = []
    monkeypatch.setattr(figures, "save", lambda fig, out, name: saved.append(fig) or [out / f"{name}.png"])
    return saved


@pytest.mark.extended
def test_leaderboard_figure_one_line_per_method_ratios_ascending_full_dashed(summary, tmp_path, drawn):
    assert figures.leaderboard(summary, tmp_path) == [tmp_path / "leaderboard.png"]
    ax = drawn[0].axes[0]
    bars = {c.get_label().split(" (")[0].rstrip(" §"): c for c in ax.containers}
    assert sorted(bars) == ["KeyDiff", "Sink", "SnapKV", "TOVA"]
    for policy, label in (("keydiff", "KeyDiff"), ("tova", "TOVA")):
        x, y = (np.asarray(v, dtype=float) for v in bars[label].lines[0].get_data())
        assert list(x) == [0.125, 0.25, 0.5, 0.75] and list(y) == SCORES[policy]  # at their x: no sideways offset
        segments = bars[label].lines[2][0].get_segments()  # the 95 % error bars, inside 0-100, around the point
        assert all(0 <= s[0][1] <= value <= s[1][1] <= 100 for s, value in zip(segments, y))
    styles = {label: (bars[label].lines[0].get_marker(), str(bars[label].lines[0].get_linestyle())) for label in bars}
    assert len(set(styles.values())) == len(styles)  # each method its own marker and line style
    full = [line for line in ax.get_lines() if line.get_linestyle() == "--" and line.get_label().startswith("Full")]
    assert len(full) == 1 and full[0].get_ydata()[0] == 90.0 and full[0].get_label().startswith("Full")
    assert [t.get_text() for t in ax.get_xticklabels()] == ["0.125", "0.25", "0.5", "0.75"]
    top = [child for child in ax.child_axes]
    assert [t.get_text() for t in top[0].get_xticklabels()] == ["0.875", "0.75", "0.5", "0.25"]
    assert "SnapKV §" in bars["SnapKV"].get_label()
    assert "11/13 tasks" in bars["Sink"].get_label()  # averaged over fewer tasks than its neighbours: said, hollow
    assert [t.get_text() for t in ax.texts] == ["11/13"]


@pytest.mark.extended
def test_leaderboard_figure_marks_a_full_cache_over_fewer_tasks(summary, tmp_path, drawn):
    summary = summary.copy()
    full = summary["policy"] == "full"
    for i, t in enumerate(TASKS):
        if i >= 2:
            summary.loc[full, [f"metrics/tasks/{t}", f"metrics/n/{t}"]] = np.nan
    figures.leaderboard(summary, tmp_path)
    ax = drawn[0].axes[0]
    line = next(line for line in ax.get_lines() if line.get_label().startswith("Full"))
    assert "2/13 tasks" in line.get_label() and line.get_linestyle() == ":"  # not a dashed line beside 13-task points
    assert "full cache: 2/13 tasks" in [t.get_text() for t in ax.texts]


@pytest.mark.extended
def test_wandb_grid_names_ratio_budgets_by_their_labels():
    """The W&B report of a ratio experiment lists "r0.5", not the "none" of a budget without tokens."""
    from keydiff.report import wandb

    assert wandb.load_grid("leaderboard_full").budgets == ["r0.5"]
    assert wandb.load_grid("smoke").budgets == ["1k"]


@pytest.mark.integration
@pytest.mark.parametrize("policy", ["full", "keydiff", "snapkv", "expected_attention", "tova"])
def test_the_engine_runs_qwen3s_architecture_exactly(policy):
    """A tiny random Qwen3 (q/k norms before RoPE): N >= L equals one forward; a small budget keeps N per head."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from keydiff.engine import prefill

    config = Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM._from_config(config, attn_implementation="sdpa", dtype=torch.float32).eval()
    prompt = torch.randint(0, 256, (1, 150))
    with torch.no_grad():
        reference = model(prompt).logits[:, -1].float()
    state = prefill(model, prompt, policy, None if policy == "full" else 150, 64)
    assert torch.allclose(state.logits, reference, atol=1e-5)
    if policy != "full":
        state = prefill(model, prompt, policy, 40, 32)
        assert all(p.shape == (1, 2, 40) for p in state.kept_positions) and state.max_cache_entries <= 40 + 32


@pytest.mark.extended
def test_leaderboard_says_which_protocol_and_marks_query_aware_rows(summary, tmp_path, drawn):
    """Protocols are separate groups and panels; a query-aware run is its own "(query-aware)" row, never averaged."""
    more = pd.DataFrame([run("keydiff", "r0.5", 20.0, 1.0, block="inf", decode_eviction=False),
                         run("snapkv", "r0.5", 33.0, 1.0, experiment="leaderboard_query_aware", query_aware=True),
                         run("snapkv", "r0.5", 11.0, 1.0)])
    frame = pd.concat([summary, more], ignore_index=True)
    table = registry.TABLES["leaderboard"]
    scores, _ = leaderboard.layout(leaderboard.runs(frame, table))
    kvpress = "kvpress's protocol (one pass, no decode eviction)"
    assert set(scores.index.get_level_values("Protocol")) == {BOUNDED, kvpress}
    assert scores.loc[("ruler_4k", "m", kvpress, "KeyDiff"), "0.5 (r=0.5)"] == 20.0
    assert scores.loc[("ruler_4k", "m", BOUNDED, "KeyDiff"), "0.5 (r=0.5)"] == 70.0
    assert scores.loc[("ruler_4k", "m", BOUNDED, "SnapKV (query-aware)"), "0.5 (r=0.5)"] == 33.0
    assert scores.loc[("ruler_4k", "m", BOUNDED, "SnapKV"), "0.5 (r=0.5)"] == 11.0
    assert leaderboard.write(frame, tmp_path, table)
    csv = pd.read_csv(tmp_path / "leaderboard.csv")
    assert set(csv["protocol"]) >= {BOUNDED, kvpress}
    figures.leaderboard(frame, tmp_path)
    titles = [ax.get_title() for ax in drawn[0].axes if ax.get_title()]
    assert any(kvpress in t for t in titles) and any(BOUNDED in t for t in titles)
