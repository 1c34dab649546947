"""RULER against the pinned revision's texts (tests/data/ruler_pinned), stored golden prompts, configuration
errors and the table (SmolLM2's tokenizer).
Regenerate the golden prompts: ``KEYDIFF_REGEN_RULER_GOLDEN=1 pytest tests/test_ruler.py``."""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

import pandas as pd
import pytest

from keydiff.report.render import interval
from keydiff.tasks.fixture_builders import ruler as ruler_fixture
from keydiff.tasks.ruler import GENERATOR_VERSION, STANDARD_TASKS, Ruler, fit_size, metric_of, postprocess
from keydiff.tasks.ruler_generators import (
    DEPTHS, NEEDLE, NOISE, QUESTION_MARKERS, RULER_COMMIT, TEMPLATES, CommonWords, FrequentWords, Niah,
    VariableTracking, essay_words, zeta,
)
from keydiff.tasks.ruler_qa import DOCUMENT, QA

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tasks/fixtures/ruler"
PINNED = ROOT / "tests/data/ruler_pinned"
GOLDEN = ROOT / "tests/data/ruler_golden"
KIND = {Niah: "niah", VariableTracking: "variable_tracking", CommonWords: "common_words_extraction",
        FrequentWords: "freq_words_extraction", QA: "qa"}


@pytest.fixture(scope="module")
def tokenizer(builtin_tokenizer):
    return builtin_tokenizer  # conftest: it marks the tests that use it real_model


def make(**overrides) -> Ruler:
    task = Ruler(**{"length": 2048, "num_samples": 2, "data_dir": str(FIXTURE), **overrides})
    task.validate()
    return task


def test_depths_and_zeta():
    import numpy as np

    assert DEPTHS == [int(x) for x in np.round(np.linspace(0, 100, num=40, endpoint=True)).astype(int)]
    assert zeta(2.0) == pytest.approx(np.pi**2 / 6, rel=1e-14)
    assert zeta(3.0) == pytest.approx(1.2020569031595942, rel=1e-14)
    n = 100_000  # direct sum plus the integral tail and the half term: error O(n^-2.5)
    assert zeta(1.5) == pytest.approx(sum(k**-1.5 for k in range(1, n)) + 2 / n**0.5 + 0.5 * n**-1.5, rel=1e-11)


def pinned(name: str):
    return json.loads((PINNED / name).read_text(encoding="utf-8"))


def test_templates_equal_the_pinned_ruler_text():
    """Fidelity: every template, answer prefix and tokens to generate equals RULER's constants.py at the pin."""
    assert pinned("constants_tasks.json")["source"].startswith(f"NVIDIA/RULER@{RULER_COMMIT}:")
    assert TEMPLATES == pinned("constants_tasks.json")["TASKS"]
    strings = pinned("strings.json")
    assert NEEDLE == strings["niah_needle"] and NOISE == strings["niah_noise"] == strings["vt_noise"]
    assert DOCUMENT == strings["qa_document"]


def test_every_task_is_ruler_s_setting_and_template():
    """Each of the 13 tasks: synthetic.yaml's arguments, its template family, tokens to generate (qa: 32), metric."""
    import yaml

    settings = yaml.safe_load((PINNED / "synthetic.yaml").read_text())
    metrics, templates = pinned("eval_metrics.json")["metric_fn"], pinned("constants_tasks.json")["TASKS"]
    assert list(settings) == list(STANDARD_TASKS)
    task = make(tasks="all")
    for name, spec in settings.items():
        gen, args = task.generator(name), spec["args"]
        assert KIND[type(gen)] == gen.kind == spec["task"], name
        assert task.tokens_to_generate(name) == templates[spec["task"]]["tokens_to_generate"]
        assert metric_of(name).__name__ == metrics[spec["task"]], name
        if isinstance(gen, Niah):
            ours = {"type_haystack": gen.haystack, "type_needle_k": gen.type_k, "type_needle_v": gen.type_v,
                    "num_needle_k": gen.num_k, "num_needle_v": gen.num_v, "num_needle_q": gen.num_q}
        elif isinstance(gen, VariableTracking):
            ours = {"type_haystack": "noise", "num_chains": gen.num_chains, "num_hops": gen.num_hops}
        elif isinstance(gen, CommonWords):
            ours = {"freq_cw": gen.freq_cw, "freq_ucw": gen.freq_ucw, "num_cw": gen.num_cw}
        elif isinstance(gen, FrequentWords):
            ours = {"alpha": gen.alpha}
        else:
            ours = {"dataset": gen.dataset}
        assert ours == args, name
    assert task.tokens_to_generate("qa_1") == task.tokens_to_generate("qa_2") == 32


def test_single_needle_template_is_ruler_s_rewrite():
    """niah with one query and one value: RULER's four replace() calls on template + answer prefix, type singular."""
    t = pinned("constants_tasks.json")["TASKS"]["niah"]
    whole = t["template"] + t["answer_prefix"]
    for old, new in pinned("strings.json")["niah_singular_replacements"]:
        whole = whole.replace(old, new)
    task = make(tasks=["niah_single_1"])
    gen, plan = task.generator("niah_single_1"), task.plan("niah_single_1", 0)
    text, prefix = gen.render(plan, 3)
    assert text + prefix == whole.format(type_needle_v="number", context=gen.context(plan, 3), query=plan["query"])


def test_question_markers_are_kvpress_patterns():
    patterns = pinned("kvpress_question_patterns.json")["QUESTION_PATTERNS"]
    short = {"niah": "niah", "variable_tracking": "vt", "common_words_extraction": "cwe",
             "freq_words_extraction": "fwe", "qa": "qa"}
    assert {kind: rx.pattern for kind, rx in QUESTION_MARKERS.items()} == {k: patterns[short[k]] for k in short}


GOLDEN_SETTINGS = dict(length=1024, seed=42, num_samples=1, chat_template=False, data_dir=str(FIXTURE),
                       haystack_dir=str(GOLDEN / "essays"))


@pytest.mark.parametrize("name", STANDARD_TASKS)
def test_golden_rendered_prompt(tokenizer, name):
    """Regression guard: sample 0 of each task, plain text, seed 42, 1024 tokens, equals the stored file."""
    task = Ruler(tasks=[name], **GOLDEN_SETTINGS)
    task.validate()
    sample = next(iter(task.samples()))
    prompt = task.build_prompt(sample, tokenizer, None)
    record = {"generator_version": GENERATOR_VERSION, "ruler_commit": RULER_COMMIT,
              "answers": sample.fields["answers"], "prompt_tokens": len(prompt.input_ids),
              "max_new_tokens": prompt.generation.max_new_tokens,
              "input_ids_sha256": hashlib.sha256(json.dumps(prompt.input_ids).encode()).hexdigest(),
              **{k: prompt.info[k] for k in ("haystack", "haystack_size", "example_size", "short")}}
    text = tokenizer.decode(prompt.input_ids)
    text_path, record_path = GOLDEN / "prompts" / f"{name}.txt", GOLDEN / "prompts" / f"{name}.json"
    if os.environ.get("KEYDIFF_REGEN_RULER_GOLDEN") == "1":
        text_path.parent.mkdir(parents=True, exist_ok=True)
        text_path.write_text(text, encoding="utf-8")
        record_path.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    assert text == text_path.read_text(encoding="utf-8")
    assert record == json.loads(record_path.read_text(encoding="utf-8"))


def test_postprocess_is_rulers():
    assert postprocess("  7325913.\x00tail\t \n") == "7325913.\ntail"
    assert postprocess("\x1fA\x7f") == "A\x7f"  # only \x00-\x1f


def test_fixture_is_what_the_builder_writes(tmp_path):
    ruler_fixture.main(["--out", str(tmp_path)])
    for name in ("squad.json", "hotpotqa.json"):
        assert (tmp_path / name).read_bytes() == (FIXTURE / name).read_bytes()


def test_kvpress_prompt_layout(tokenizer):
    sample = next(iter(make(tasks=["niah_single_1"], length=1024).samples()))
    key = sample.fields["query"]

    def prompt_text(**settings):
        task = make(tasks=["niah_single_1"], length=1024, **settings)
        return tokenizer.decode(task.build_prompt(sample, tokenizer, None).input_ids)

    # kvpress's split: the prefix's leading space ends the user turn, the prefix follows the header directly
    kv_text = prompt_text(answer_prefix_style="kvpress")
    answer_prefix = f"The special magic number for {key} mentioned in the provided text is"
    assert kv_text.endswith(f"<|im_start|>assistant\n{answer_prefix}")
    assert "mentioned in the provided text? <|im_end|>" in kv_text
    assert prompt_text(answer_prefix_style="kvpress", chat_template=False).endswith(
        f"provided text? \n{answer_prefix}")


def test_too_short_length_names_the_task(tokenizer):
    task = make(tasks=["vt"], length=300)
    with pytest.raises(ValueError, match=r"RULER vt at task.length=300"):
        task.build_prompt(next(iter(task.samples())), tokenizer, None)


def test_fit_size_reference():
    measure = lambda s: 10 + 3 * s  # noqa: E731
    assert fit_size(measure, 100, 1, None) == 30  # doubling, then bisection
    assert fit_size(measure, 100, 1, 5) == 5  # all of [low, high] fits
    with pytest.raises(ValueError, match="smallest haystack"):
        fit_size(lambda s: 100 + s, 50, 1, None)


def test_summarize_boundary_of_the_guard():
    rows = [{"sample_id": f"vt/{i}", "scores": {"score": s}, "info": {"short": short}}
            for i, (s, short) in enumerate([(1.0, False), (0.0, True), (0.0, False)])]
    summary = make(tasks=["vt"]).summarize(rows)
    assert summary["tasks"] == {"vt": 50.0} and summary["short"] == {"vt": 1}
    assert make(tasks=["vt"]).summarize(rows[:2])["tasks"] == {"vt": 100.0}


@pytest.mark.parametrize("name", STANDARD_TASKS)
def test_gold_scores_one_and_wrong_scores_zero(name):
    task = make(tasks=[name])
    sample = next(iter(task.samples()))
    answers = sample.fields["answers"]
    assert task.score(sample, " " + ", ".join(answers) + ".")["score"] == 1.0
    assert task.score(sample, " " + ", ".join(a.upper() for a in answers))["score"] == 1.0  # case-insensitive
    wrong = " ".join("zq" + a[::-1] + "zq" for a in answers)
    assert task.score(sample, wrong)["score"] == 0.0
    if len(answers) > 1:
        expected = 1.0 if name.startswith("qa_") else 1 / len(answers)
        assert task.score(sample, answers[0])["score"] == pytest.approx(expected)


@pytest.mark.parametrize("overrides, message", [
    ({"tasks": ["niah_single_9"]}, "valid tasks: niah_single_1"),
    ({"tasks": "everything"}, "or a preset: all, synthetic"),
    ({"tasks": ["vt", "vt"]}, "repeats"),
    ({"data_dir": None}, "need task.data_dir.*download_qa_dataset.sh"),
    ({"answer_prefix_style": "kv"}, r"answer_prefix_style='kv' is not valid; choose one of \['ruler', 'kvpress'\]"),
    ({"data_dir": "/nonexistent/qa"}, r"expected one of \['squad.json'"),
    ({"length": 0}, "task.length must be a positive integer"),
    ({"limit": 0}, "task.limit"),
    ({"haystack_dir": "/nonexistent"}, "not a folder of .txt files nor RULER's PaulGrahamEssays.json"),
    ({"max_new_tokens": 0}, "max_new_tokens"),
])
def test_config_errors_name_valid_choices(overrides, message):
    with pytest.raises(ValueError, match=message):
        Ruler(**{"data_dir": str(FIXTURE), **overrides}).validate()


@pytest.mark.extended
def test_errors_come_before_the_model_loads(monkeypatch, tmp_path):
    from keydiff.run import runner
    from keydiff.run.plan import plan_run
    from tests.test_runner import make_cfg

    monkeypatch.setattr(runner, "load_model", lambda *a, **k: pytest.fail("the model must not be loaded"))
    with pytest.raises(ValueError, match="need task.data_dir"):
        runner.run(make_cfg("task=ruler_4k"), tmp_path / "run")
    with pytest.raises(ValueError, match="exceeds the model's max_length"):
        runner.run(make_cfg("task=ruler_16k", "task.tasks=synthetic"), tmp_path / "run")
    assert not (tmp_path / "run").exists()
    plan = plan_run(make_cfg("task=ruler_8k", "task.tasks=synthetic", "task.answer_prefix_style=kvpress"))
    assert (plan.task.length, len(plan.task.tasks), plan.task.answer_prefix_style) == (8192, 11, "kvpress")


def test_haystack_source_in_rows_and_summary(tmp_path):
    rows = [{"sample_id": "niah_single_2/0", "scores": {"score": 1.0}, "info": {}},
            {"sample_id": "niah_single_1/0", "scores": {"score": 1.0}, "info": {}}]
    default = make(tasks=["niah_single_1", "niah_single_2"])
    summary = default.summarize(rows)
    assert summary["haystack"] == {"niah_single_1": "noise", "niah_single_2": "essay:pydoc_pinned"}
    assert summary["comparable_to_published"] is False and "pydoc" in summary["not_comparable"][0]
    assert summary["ruler_commit"] == RULER_COMMIT
    assert make(tasks=["niah_single_1"]).summarize(rows[1:])["comparable_to_published"] is True  # no essay task
    qa = make(tasks=["qa_2"])
    assert qa.not_comparable(["qa_2"]) == ["QA ran on the project's made-up fixture, not SQuAD/HotpotQA"]
    sources = qa.data_sources()  # what summary.json's "data" records
    assert any(k.startswith("ruler/hotpotqa/") for k in sources) and any(k.startswith("wonderwords==") for k in sources)
    # RULER's download script writes PaulGrahamEssays.json; the folder holding it (or the file) is a haystack
    text = "First essay.  It has\nlines.\n\nSecond essay, with more words. "
    (tmp_path / "PaulGrahamEssays.json").write_text(json.dumps({"text": text}))
    for where in (tmp_path, tmp_path / "PaulGrahamEssays.json"):
        essays = make(tasks=["niah_single_2"], haystack_dir=str(where))
        # RULER's own split (which keeps an empty word for leading/trailing whitespace; ours strips it)
        assert essays._essay_words() == tuple(re.sub(r"\s+", " ", text).split(" "))[:-1]
        assert essays.summarize(rows[:1])["comparable_to_published"] is True
        assert essays.haystack_of("niah_single_2") == "essay:ruler_json"
        assert any(k.startswith("ruler/essay[ruler_json]/") for k in essays.data_sources())
    (tmp_path / "other.json").write_text(json.dumps({"essays": []}))
    with pytest.raises(ValueError, match="is not RULER's essay file"):
        make(tasks=["niah_single_2"], haystack_dir=str(tmp_path / "other.json"))._essay_words()
    txt = make(tasks=["niah_single_2"], haystack_dir=str(GOLDEN / "essays"))
    assert txt.haystack_of("niah_single_2") == "essay:txt_dir" and essay_words("a  b\nc") == ["a", "b", "c"]


def test_ruler_table(tmp_path):
    from keydiff.report import ruler as ruler_table

    essays = {t: ("essay:ruler_json" if t in ("niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multivalue",
                                              "niah_multiquery") else "noise") for t in STANDARD_TASKS}
    runs = (
        # a comparable full run, one subset run on the pydoc haystack with QA short samples, one old summary
        ("full", "unbounded", None, {t: 90.0 for t in STANDARD_TASKS},
         {"haystack": {**essays, "qa_1": "squad:file", "qa_2": "hotpotqa:file"}, "comparable_to_published": True,
          "not_comparable": [], "short": {t: 0 for t in STANDARD_TASKS}}),
        ("keydiff", "1k", 2, {"vt": 50.0, "cwe": 10.0, "qa_1": 40.0},
         {"haystack": {"vt": "noise", "cwe": "wonderwords", "niah_single_2": "essay:pydoc", "qa_1": "squad:fixture",
                       "qa_2": "hotpotqa:fixture"},
          "comparable_to_published": False, "not_comparable": ["essay haystack is pydoc prose", "QA fixture"],
          "short": {"vt": 0, "cwe": 0, "qa_1": 1, "qa_2": 2, "niah_single_2": 0}}),
        ("tova", "2k", None, {t: 80.0 for t in STANDARD_TASKS}, {}),
    )
    for policy, budget, limit, scores, extra in runs:
        run_dir = tmp_path / "runs" / policy
        run_dir.mkdir(parents=True)
        summary = {
            "config": {"experiment_name": "ruler", "model": {"name": "m"}, "policy": {"label": policy},
                       "budget": {"label": budget}, "task": {"_target_": "keydiff.tasks.ruler.Ruler", "length": 4096,
                                                             "limit": limit}},
            "metrics": {"tasks": scores, "average": round(sum(scores.values()) / len(scores), 2),
                        "n": {t: 2 for t in scores}, **extra},
            "block_size": 128,
        }
        (run_dir / "summary.json").write_text(json.dumps(summary))
    # per-sample rows of the subset run: its intervals (short samples left out, as from the scores)
    predictions = [("vt", 1.0, False), ("vt", 0.0, False), ("cwe", 0.0, False), ("cwe", 0.2, False),
                   ("qa_1", 0.3, False), ("qa_1", 0.5, False), ("qa_1", 1.0, True), ("qa_2", 0.0, True),
                   ("qa_2", 0.0, True)]
    (tmp_path / "runs" / "keydiff" / "predictions.jsonl").write_text("".join(
        json.dumps({"sample_id": f"{t}/{i}", "scores": {"score": v}, "info": {"short": short}}) + "\n"
        for i, (t, v, short) in enumerate(predictions)))
    (tmp_path / "runs" / "other").mkdir()
    (tmp_path / "runs" / "other" / "summary.json").write_text(json.dumps({"config": {"task": {}}, "metrics": {}}))
    df = ruler_table.main(tmp_path / "runs", tmp_path / "tables")
    assert len(df) == 3
    text = (tmp_path / "tables" / "ruler.md").read_text()
    # rows by length, model, budget (the full cache last), not by run folder (full, keydiff, tova)
    order = [line.split(" | ")[1] for line in text.splitlines() if line.startswith("| m | ")]
    assert order == ["keydiff", "tova", "full"], order
    header = next(line for line in text.splitlines() if line.startswith("| model |")).strip("| ").split(" | ")
    rows = {r.split(" | ")[1]: dict(zip(header, r.strip("| ").split(" | ")))
            for r in text.splitlines() if r.startswith("| m |")}
    # no predictions.jsonl, no SE: the average's interval is the widest-spread one over its 26 samples (2 per task),
    # inside 0-100 (Wilson, keydiff/report/render.py)
    low, high = interval(90.0, float("nan"), 26, (0.0, 100.0))
    assert rows["full"]["avg"] == f"90.00 [{low:.2f}, {high:.2f}]" and high <= 100
    assert rows["full"]["haystack"] == "ruler_json" and rows["full"]["qa"] == "file"
    subset = rows["keydiff"]
    assert subset["haystack"] == "pydoc" and subset["qa"] == "fixture"
    # 2 samples per task: too few for an interval (not 50.00 ± 98.00, twice the range)
    assert subset["qa_1"] == "40.00 [n too small]↓1" and subset["qa_2"] == "–↓2"
    assert subset["vt"] == "50.00 [n too small]"
    # avg: 100 x SE vt 50 (1, 0), cwe 10 (0, 0.2), qa_1 10 (0.3, 0.5; the short 1.0 left out): sqrt(sum SE^2) / 3,
    # over the 10 samples of its 5 tasks
    low, high = interval(33.33, 2700 ** 0.5 / 3, 10, (0.0, 100.0))
    assert subset["avg"] == f"33.33 [{low:.2f}, {high:.2f}]§↓3‡ (3/13)"
    low, high = interval(80.0, float("nan"), 26, (0.0, 100.0))
    assert rows["tova"]["avg"] == f"80.00 [{low:.2f}, {high:.2f}]‡" and rows["tova"]["haystack"] == "unrecorded"
    assert "‡: essay haystack is pydoc prose; QA fixture" in text and "haystack and QA data not recorded" in text
    csv = pd.read_csv(tmp_path / "tables" / "ruler.csv")
    assert list(csv.sort_values("policy")["short"]) == [0, 3, 0]
    assert list(csv.sort_values("policy")["haystack"]) == ["ruler_json", "pydoc", "unrecorded"]
