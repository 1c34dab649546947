"""RULER against the pinned revision's texts (tests/data/ruler_pinned), stored golden prompts, brute-force checks,
the length guard, configuration errors and the table (SmolLM2's tokenizer).
Regenerate the golden prompts: ``KEYDIFF_REGEN_RULER_GOLDEN=1 pytest tests/test_ruler.py``."""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
from collections import Counter
from pathlib import Path

import pandas as pd
import pytest

from keydiff.report.render import interval
from keydiff.tasks.fixture_builders import ruler as ruler_fixture
from keydiff.tasks.ruler import (
    GENERATOR_VERSION, MIN_LENGTH_FRACTION, PRESETS, STANDARD_TASKS, Ruler, fit_size, metric_of, postprocess,
    string_match_all, string_match_part,
)
from keydiff.tasks.ruler_generators import (
    DEPTHS, NEEDLE, NOISE, QUESTION_MARKERS, RULER_COMMIT, TEMPLATES, CommonWords, FrequentWords, Niah,
    VariableTracking, essay_words, split_sentences, zeta,
)
from keydiff.tasks.ruler_qa import DOCUMENT, FIXTURE_SHA256, QA

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tasks/fixtures/ruler"
PINNED = ROOT / "tests/data/ruler_pinned"
GOLDEN = ROOT / "tests/data/ruler_golden"
SYNTHETIC = PRESETS["synthetic"]
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


def test_sentence_split():
    text = 'It works, e.g. here. Then "Quoted." Next one! Done? yes. Last'
    assert split_sentences(text) == ["It works, e.g. here.", 'Then "Quoted."', "Next one!", "Done? yes.", "Last"]


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
    metrics = pinned("eval_metrics.json")["metric_fn"]
    assert list(settings) == list(STANDARD_TASKS)
    task = make(tasks="all")
    for name, spec in settings.items():
        gen, args = task.generator(name), spec["args"]
        assert KIND[type(gen)] == gen.kind == spec["task"], name
        assert task.tokens_to_generate(name) == pinned("constants_tasks.json")["TASKS"][spec["task"]]["tokens_to_generate"]
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


def brute_contains(haystack: str, needle: str) -> bool:
    """Substring test by explicit window comparison, lowercased (reference for the metrics)."""
    h, n = haystack.lower(), needle.lower()
    return any(all(h[i + j] == n[j] for j in range(len(n))) for i in range(len(h) - len(n) + 1)) or n == ""


def test_metrics_match_brute_force():
    rng = random.Random(0)
    alphabet = "abAB1 -"
    for _ in range(400):
        pred = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 12)))
        refs = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 3))) for _ in range(rng.randint(1, 4))]
        hits = [brute_contains(pred, r) for r in refs]
        assert string_match_all(pred, refs) == pytest.approx(sum(hits) / len(refs))
        assert string_match_part(pred, refs) == float(any(hits))


def test_postprocess_is_rulers():
    assert postprocess("  7325913.\x00tail\t \n") == "7325913.\ntail"
    assert postprocess("\x1fA\x7f") == "A\x7f"  # only \x00-\x1f


def rendered(task: Ruler, name: str, index: int, size: int) -> tuple[dict, str, str]:
    gen = task.generator(name)
    plan = task.plan(name, index)
    example = gen.example(plan, 3 * gen.example_min_size(plan)) if gen.example_length else ""
    text, prefix = gen.render(plan, size, example)
    return plan, text, prefix


@pytest.mark.parametrize("name", [t for t in STANDARD_TASKS if t.startswith("niah")])
def test_niah_needles_answer_the_question(name):
    task = make(tasks=[name])
    gen = task.generator(name)
    for index in range(2):
        plan, text, prefix = rendered(task, name, index, 60)
        lines = re.findall(r"One of the special magic (\w+) for (.+?) is: (\S+)\.", text)
        keys = [k.strip() for k in plan["query"].replace(", and ", ", ").split(", ")]
        assert len(keys) == gen.num_q
        found = [v for _, k, v in lines if k in keys]
        assert sorted(found) == sorted(plan["answers"]) and len(found) == gen.num_q * gen.num_v
        assert all(kind == gen.type_v for kind, _, _ in lines)
        assert all(a in text for a in plan["answers"]) and plan["query"] in text and plan["query"] in prefix
        if gen.haystack == "needle":
            assert len(lines) == 60 + len(plan["needles"])  # every haystack line is a needle
        elif gen.haystack == "noise":
            assert text.count(NOISE) == 60
        single = gen.num_q * gen.num_v == 1
        assert text.startswith("A special magic" if single else "Some special magic")
        assert prefix.endswith(" is" if single else " are")


def test_vt_chain_resolves_to_the_answers():
    task = make(tasks=["vt"])
    for index in range(3):
        plan, text, prefix = rendered(task, "vt", index, 40)
        main = text[text.rindex("Memorize and track"):]  # the example comes first (RULER)
        assignments = dict(re.findall(r"VAR ([A-Z]+) = ((?:VAR )?[A-Z0-9]+)", main))
        value, reached = plan["query"], set()
        frontier = {v for v, rhs in assignments.items() if rhs == value}
        while frontier:
            reached |= frontier
            frontier = {v for v, rhs in assignments.items() if rhs.startswith("VAR ") and rhs[4:] in frontier} - reached
        assert reached == set(plan["answers"]) and len(reached) == 5
        # RULER@pin: noise lines and statements joined by "\n" (2024: "noise\n" joined by spaces)
        lines = main.split("following text.\n\n")[1].split("\nQuestion:")[0].split("\n")
        assert lines.count(NOISE) == 40 and len(lines) == 45 and "\n " not in text
        assert f"{len(plan['answers'])} variables are assigned the value {value}" in prefix


@pytest.mark.parametrize("length", [2048, 4096])
def test_cwe_answers_are_the_most_common_words(length):
    task = make(tasks=["cwe"], length=length)
    plan, text, _ = rendered(task, "cwe", 0, 50)
    main = text.split("\nBelow is a numbered list")[-1].split("\nQuestion:")[0]
    counts = Counter(re.findall(r"\d+\. (.+?)(?= \d+\. |$)", main))
    top = {w for w, c in counts.items() if c == max(counts.values())}
    assert top == set(plan["answers"]) and len(top) == 10
    assert max(c for w, c in counts.items() if w not in top) < min(counts[w] for w in top)
    assert counts[plan["answers"][0]] == (30 if length >= 4096 else 6)
    # RULER@pin: the example is template + answer prefix, a space, its numbered answer, then a newline
    example = text.split("\nBelow is a numbered list")[0]
    assert re.search(r"in the list are: 1\. \S+ 2\. .* 10\. \S+$", example) and example.count("Question:") == 1


def test_fwe_answers_are_ranks_two_to_four():
    task = make(tasks=["fwe"], length=4096)
    gen = task.generator("fwe")
    plan = task.plan("fwe", 0)
    for size in (gen.min_size(plan), 500, 3000):
        text, _ = gen.render(plan, size)
        words = text.split("coded words. ")[1].split("\nQuestion:")[0].split()
        counts = Counter(w for w in words if w != "...")
        ranked = counts.most_common()
        assert {w for w, _ in ranked[:3]} == set(plan["answers"])
        assert ranked[2][1] > (ranked[3][1] if len(ranked) > 3 else 0)
        assert Counter(words)["..."] > ranked[0][1]  # the dots are the most frequent "word"
    assert len(plan["vocab"]) == (4096 - 50) // 50  # RULER: the length less the 50 to generate, // 50


@pytest.mark.parametrize("name", ["qa_1", "qa_2"])
def test_qa_gold_document_is_in_the_context(name):
    task = make(tasks=[name])
    gen = task.generator(name)
    assert isinstance(gen, QA)
    documents = len(gen.data.documents)
    for index, sample in enumerate(task.samples()):
        plan = task.plan(name, index)
        for size in (gen.min_size(plan), documents - 1, documents, 2 * documents + 3):
            text, prefix = gen.render(plan, size)
            assert any(a in text for a in plan["answers"]) and plan["query"] in text and prefix == " Answer:"
            assert text.count("Document ") == size
        # at or above the number of documents, every document is in and they repeat (RULER's rule)
        text, _ = gen.render(plan, 2 * documents + 3)
        assert all(text.count(doc) >= 2 for doc in gen.data.documents)
    if name == "qa_1":  # the unanswerable fixture question is dropped, as RULER does
        assert all("brass" not in task.plan(name, i)["query"] for i in range(len(gen.data.questions)))


def test_fixture_is_what_the_builder_writes(tmp_path):
    ruler_fixture.main(["--out", str(tmp_path)])
    for name in ("squad.json", "hotpotqa.json"):
        assert (tmp_path / name).read_bytes() == (FIXTURE / name).read_bytes()


def test_samples_are_index_major_and_limited():
    task = make(tasks=["niah_single_1", "vt"], num_samples=3, limit=2)
    assert [s.id for s in task.samples()] == ["niah_single_1/0", "vt/0", "niah_single_1/1", "vt/1"]


def test_answers_differ_by_seed_length_and_sample():
    """Determinism is the golden prompts' check; another seed, length or sample index draws other answers."""
    tasks = ["niah_single_2", "niah_multikey_2", "vt", "cwe", "fwe"]  # qa sample i asks question i of the file
    answers = lambda **settings: [s.fields["answers"] for s in make(tasks=tasks, **settings).samples()]  # noqa: E731
    mine = answers()
    for other in (answers(seed=7), answers(length=2100)):
        assert all(a != b for a, b in zip(mine[: len(tasks)], other)), other
    assert all(mine[i] != mine[i + len(tasks)] for i in range(len(tasks)))  # sample 0 vs 1 of a task


def test_length_fitting_is_tight(tokenizer):
    length = 4096
    task = make(tasks=list(SYNTHETIC), length=length, num_samples=1)
    for sample in task.samples():
        prompt = task.build_prompt(sample, tokenizer, None)
        name, total = sample.fields["task"], len(prompt.input_ids) + prompt.generation.max_new_tokens
        assert total <= length, name
        assert prompt.info["length_fraction"] == round(total / length, 4) and prompt.info["short"] is False, name
        gen, plan = task.generator(name), task.plan(name, 0)
        example = gen.example(plan, prompt.info["example_size"]) if gen.example_length else ""
        bigger = len(task.encode(tokenizer, *gen.render(plan, prompt.info["haystack_size"] + 1, example))[0])
        assert bigger + prompt.generation.max_new_tokens > length, name  # one more unit would not fit
        assert total >= 0.9 * length, name
        assert prompt.generation.max_new_tokens == {"vt": 30, "cwe": 120, "fwe": 50}.get(name, 128)
        text = tokenizer.decode(prompt.input_ids)
        assert all(answer in text for answer in sample.fields["answers"]), name


def test_prompt_layout_chat_and_kvpress(tokenizer):
    """The chat and kvpress layouts (the plain one is niah_single_1's golden prompt)."""
    sample = next(iter(make(tasks=["niah_single_1"], length=1024).samples()))
    key = sample.fields["query"]

    def prompt_text(**settings):
        task = make(tasks=["niah_single_1"], length=1024, **settings)
        return tokenizer.decode(task.build_prompt(sample, tokenizer, None).input_ids)

    prompt = make(tasks=["niah_single_1"], length=1024).build_prompt(sample, tokenizer, None)
    assert tokenizer.decode(prompt.input_ids).endswith(
        f"<|im_start|>assistant\n The special magic number for {key} mentioned in the provided text is")
    question = tokenizer.decode(prompt.input_ids[prompt.info["question_token_index"]:])
    assert question.startswith(f"What is the special magic number for {key}")
    # kvpress's split: the prefix's leading space ends the user turn, the prefix follows the header directly
    kv_text = prompt_text(answer_prefix_style="kvpress")
    assert kv_text.endswith(f"<|im_start|>assistant\nThe special magic number for {key} mentioned in the provided text is")
    assert "mentioned in the provided text? <|im_end|>" in kv_text
    assert prompt_text(answer_prefix_style="kvpress", chat_template=False).endswith(
        f"provided text? \nThe special magic number for {key} mentioned in the provided text is")


def test_vt_example_fits_its_500_tokens(tokenizer):
    task = make(tasks=["vt"], length=4096)
    sample = next(iter(task.samples()))
    prompt = task.build_prompt(sample, tokenizer, None)
    gen, plan = task.generator("vt"), task.plan("vt", 0)
    size = prompt.info["example_size"]

    def count(text):
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    # RULER fits the example's input (template + answer prefix, without its answer) to 500 tokens
    assert count(gen.example_input(plan, size)) <= 500 < count(gen.example_input(plan, size + 1))
    example = gen.example(plan, size)
    assert example == gen.example_input(plan, size) + " " + " ".join(plan["example_answers"]) + "\n"
    assert all(v not in example for v in plan["answers"])
    assert tokenizer.decode(prompt.input_ids).count(example + "\nMemorize and track") == 1


def test_too_short_length_names_the_task(tokenizer):
    task = make(tasks=["vt"], length=300)
    with pytest.raises(ValueError, match=r"RULER vt at task.length=300"):
        task.build_prompt(next(iter(task.samples())), tokenizer, None)


def test_fit_size_reference():
    for slope in (1, 3, 7):
        for target in range(20, 200, 17):
            measure = lambda s: 10 + slope * s  # noqa: E731
            assert fit_size(measure, target, 1, None) == max(s for s in range(1, 500) if measure(s) <= target)
            assert fit_size(measure, target, 1, 5) == min(5, (target - 10) // slope)
    with pytest.raises(ValueError, match="smallest haystack"):
        fit_size(lambda s: 100 + s, 50, 1, None)


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


def test_summarize_rounds_per_task_then_averages():
    rows = [{"sample_id": f"{t}/{i}", "scores": {"score": s}}
            for t, scores in {"vt": [1, 0, 0], "cwe": [0.1, 0.2, 0.25], "qa_1": [1, 1, 1]}.items()
            for i, s in enumerate(scores)]
    summary = make(tasks=["vt", "cwe", "qa_1"]).summarize(rows)
    assert summary["tasks"] == {"vt": 33.33, "cwe": 18.33, "qa_1": 100.0}
    assert list(summary["tasks"]) == ["vt", "cwe", "qa_1"]
    assert summary["average"] == round((33.33 + 18.33 + 100.0) / 3, 2)
    assert summary["metric"]["qa_1"] == "string_match_part" and summary["metric"]["vt"] == "string_match_all"
    assert summary["n"] == {"vt": 3, "cwe": 3, "qa_1": 3} and summary["all_standard_tasks"] is False


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


def test_missing_qa_data_message_names_the_real_data_first_and_the_fixture_for_a_smoke_only(monkeypatch):
    """The missing-QA error names the real data first and the made-up fixture last, as a smoke test only."""
    monkeypatch.chdir(ROOT)
    with pytest.raises(ValueError) as error:
        Ruler(tasks=["qa_1"]).validate()
    message = str(error.value)
    order = [message.find(part) for part in ("squad.json", "download_qa_dataset.sh", "task.tasks=synthetic",
                                             "task.data_dir=tasks/fixtures/ruler")]
    assert -1 not in order and order == sorted(order), message
    assert "made-up" in message and "not comparable" in message and "\n" not in message
    Ruler(tasks=["qa_1"], data_dir="tasks/fixtures/ruler").validate()  # what it names works


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


def test_short_sample_is_flagged_and_kept_out(tokenizer, monkeypatch):
    """QA on a data set too small for the length (capped here) gives a short sample: flagged, not scored."""
    task = make(tasks=["qa_1", "vt"], length=4096, num_samples=1)
    gen = task.generator("qa_1")
    monkeypatch.setattr(type(gen), "max_size", lambda self, plan: 3)  # three documents, far below 4096 tokens
    rows = []
    for sample in task.samples():
        prompt = task.build_prompt(sample, tokenizer, None)
        total = len(prompt.input_ids) + prompt.generation.max_new_tokens
        assert prompt.info["short"] is (total < MIN_LENGTH_FRACTION * 4096)
        rows.append({"sample_id": sample.id, "scores": {"score": 1.0 if sample.id.startswith("qa") else 0.5},
                     "info": prompt.info})
    assert [r["info"]["short"] for r in rows] == [True, False]
    summary = task.summarize(rows)
    assert summary["tasks"] == {"vt": 50.0} and summary["average"] == 50.0  # the short qa sample is left out
    assert summary["short"] == {"vt": 0, "qa_1": 1} and summary["n"] == {"vt": 1, "qa_1": 0}


def test_summarize_boundary_of_the_guard():
    rows = [{"sample_id": f"vt/{i}", "scores": {"score": s}, "info": {"short": short}}
            for i, (s, short) in enumerate([(1.0, False), (0.0, True), (0.0, False)])]
    summary = make(tasks=["vt"]).summarize(rows)
    assert summary["tasks"] == {"vt": 50.0} and summary["short"] == {"vt": 1}
    assert make(tasks=["vt"]).summarize(rows[:2])["tasks"] == {"vt": 100.0}


def test_fixture_qa_fills_the_length_by_repetition_and_is_marked(tokenizer):
    task = make(tasks=["qa_1", "qa_2"], length=2048, num_samples=1)
    for sample in task.samples():
        prompt = task.build_prompt(sample, tokenizer, None)
        assert prompt.info["short"] is False and prompt.info["haystack"].endswith(":fixture")
    assert task.not_comparable(["qa_1"]) == ["QA ran on the project's made-up fixture, not SQuAD/HotpotQA"]
    assert {hashlib.sha256((FIXTURE / n).read_bytes()).hexdigest() for n in ("squad.json", "hotpotqa.json")} \
        == FIXTURE_SHA256
    sources = task.data_sources()  # what summary.json's "data" records
    assert any(k.startswith("ruler/hotpotqa/") for k in sources) and any(k.startswith("wonderwords==") for k in sources)


def test_haystack_source_in_rows_and_summary(tmp_path):
    rows = [{"sample_id": "niah_single_2/0", "scores": {"score": 1.0}, "info": {}},
            {"sample_id": "niah_single_1/0", "scores": {"score": 1.0}, "info": {}}]
    default = make(tasks=["niah_single_1", "niah_single_2"])
    summary = default.summarize(rows)
    assert summary["haystack"] == {"niah_single_1": "noise", "niah_single_2": "essay:pydoc_pinned"}
    assert summary["comparable_to_published"] is False and "pydoc" in summary["not_comparable"][0]
    assert summary["ruler_commit"] == RULER_COMMIT
    assert make(tasks=["niah_single_1"]).summarize(rows[1:])["comparable_to_published"] is True  # no essay task
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
    assert subset["qa_1"] == "40.00 [n too small]↓1" and subset["qa_2"] == "–↓2" and subset["vt"] == "50.00 [n too small]"
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
