"""The LongBench task: templates, prompts (truncation, chat), data loading, summaries. The byte-level tokenizer
made here (one token per UTF-8 byte, BOS prepended) makes every token count a byte count plus one."""

from __future__ import annotations

import hashlib
import json
import math
import shutil
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from keydiff.tasks import longbench as lb
from keydiff.tasks.fixture_builders import longbench as fixture_builder
from keydiff.tasks.base import Sample

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tasks" / "fixtures" / "longbench"


@pytest.fixture(scope="module")
def tokenizer():
    vocab = {"<bos>": 0, "<eos>": 1}
    for char in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[char] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))  # no merges: one token per byte
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 0)])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<bos>", eos_token="<eos>")
    tok.chat_template = (
        "{{ bos_token }}{% for m in messages %}[USER]{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}[BOT]{% endif %}"
    )
    return tok


def records(stem: str) -> list[dict]:
    return [json.loads(line) for line in (FIXTURE / "data" / f"{stem}.jsonl").read_text(encoding="utf-8").splitlines()]


def task(**kwargs) -> lb.LongBench:
    kwargs.setdefault("data_dir", str(FIXTURE))
    return lb.LongBench(**kwargs)


def sample_of(t: lb.LongBench, sample_id: str) -> Sample:
    return next(s for s in t.samples() if s.id == sample_id)


def byte_ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def test_dataset_table_and_presets():
    assert len(lb.ALL_21) == 21 and len(lb.ENGLISH_16) == 16 and len(lb.LONGBENCH_E_13) == 13
    chinese = {"multifieldqa_zh", "dureader", "vcsum", "lsht", "passage_retrieval_zh"}
    assert set(lb.ALL_21) - set(lb.ENGLISH_16) == chinese
    assert set(lb.LONGBENCH_E_13) <= set(lb.ALL_21)
    assert lb.ENGLISH_16[:3] == ("narrativeqa", "qasper", "multifieldqa_en") and lb.ENGLISH_16[-1] == "repobench-p"
    assert lb.NO_CHAT_DATASETS == {"trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p"}
    assert lb.FIRST_LINE_DATASETS == {"trec", "triviaqa", "samsum", "lsht"}
    assert lb.DATASET2MAXLEN["gov_report"] == 512 and lb.DATASET2MAXLEN["hotpotqa"] == 32
    assert lb.DATASET2MAXLEN["narrativeqa"] == 128 and lb.DATASET2MAXLEN["lcc"] == 64
    assert lb.DATASETS["vcsum"].metric.__name__ == "rouge_zh_score"
    assert lb.DATASETS["repobench-p"].metric.__name__ == "code_sim_score"
    assert set(lb.DATASET2PROMPT) == set(lb.ALL_21)


def test_templates_verbatim_spot_checks():
    p = lb.DATASET2PROMPT
    assert p["narrativeqa"].count("asconcisely") == 2
    assert p["narrativeqa"].endswith("Do not provide any explanation.\n\nQuestion: {input}\n\nAnswer:")
    assert "Article: {context}\n\n Answer the question based on the above article" in p["qasper"]
    assert "Write a one-page summary of all news. \n\nNews:\n{context}" in p["multi_news"]
    assert p["lcc"] == "Please complete the code given below. \n{context}Next line of code:\n"
    assert p["repobench-p"] == "Please complete the code given below. \n{context}{input}Next line of code:\n"
    assert p["passage_count"].endswith("The final answer is: ")
    assert p["passage_retrieval_en"].endswith('"Paragraph 1", "Paragraph 2", etc.\n\nThe answer is: ')
    assert p["trec"].endswith("Here are some examples of questions.\n\n{context}\n{input}")
    assert p["triviaqa"].endswith("The following are some examples.\n\n{context}\n\n{input}")
    assert p["lsht"] == "请判断给定新闻的类别，下面是一些例子。\n\n{context}\n{input}"
    assert '答案格式必须是"段落1"，"段落2"等格式' in p["passage_retrieval_zh"]
    assert p["multifieldqa_zh"].endswith("问题：{input}\n回答：")
    assert p["vcsum"] == "下面有一段会议记录，请你阅读后，写一段总结，总结会议的内容。\n会议记录：\n{context}\n\n会议总结："


@pytest.mark.parametrize("kwargs, message", [
    ({"datasets": ["narrative_qa"]}, "valid LongBench datasets: narrativeqa, qasper.*repobench-p"),
    ({"datasets": ["narrativeqa"], "longbench_e": True}, "valid LongBench-E datasets: qasper, multifieldqa_en"),
    ({"fuzzy_backend": "rapidfuzz"}, "valid backends: difflib, levenshtein"),
    ({"datasets": ["lcc", "lcc"]}, "more than once"),
    ({"limit": 0}, "limit"),
    ({"data_dir": "/nonexistent/longbench"}, "does not exist"),
    ({"sha256": "abc"}, "sha256"),
])
def test_bad_settings_name_valid_choices(kwargs, message):
    with pytest.raises(ValueError, match=message):
        task(**kwargs).validate()


def test_samples_from_folder_ids_order_and_hashes():
    t = task(datasets=["trec", "narrativeqa"])
    samples = list(t.samples())
    assert [s.id for s in samples] == ["trec/0", "trec/1", "trec/2", "narrativeqa/0", "narrativeqa/1", "narrativeqa/2"]
    assert samples[3].fields["record"] == records("narrativeqa")[0]
    assert samples[0].fields["all_classes"] == records("trec")[-1]["all_classes"]  # eval.py: the last line's
    expected = {
        f"longbench/data/{name}.jsonl": hashlib.sha256((FIXTURE / "data" / f"{name}.jsonl").read_bytes()).hexdigest()
        for name in ("trec", "narrativeqa")
    }
    assert t.data_sources() == expected


def test_limit_and_bare_jsonl_folder():
    t = task(datasets=["lcc", "samsum"], limit=1, data_dir=str(FIXTURE / "data"))  # <dir>/<name>.jsonl
    assert [s.id for s in t.samples()] == ["lcc/0", "samsum/0"]
    assert sorted(t.data_sources()) == ["longbench/lcc.jsonl", "longbench/samsum.jsonl"]


def test_longbench_e_reads_e_files():
    t = task(datasets=["qasper", "lcc"], longbench_e=True)
    samples = list(t.samples())
    assert [s.id for s in samples] == ["qasper/0", "qasper/1", "qasper/2", "lcc/0", "lcc/1", "lcc/2"]
    assert [s.fields["record"]["length"] for s in samples[:3]] == [3999, 4000, 8000]
    assert sorted(t.data_sources()) == ["longbench/data/lcc_e.jsonl", "longbench/data/qasper_e.jsonl"]


def test_zip_data_dir(tmp_path):
    zip_path = fixture_builder.write_zip(FIXTURE, tmp_path / "data.zip")
    from_zip = task(datasets=["lsht"], data_dir=str(zip_path))
    from_folder = task(datasets=["lsht"])
    assert [s.fields for s in from_zip.samples()] == [s.fields for s in from_folder.samples()]
    sources = from_zip.data_sources()
    assert sources["longbench/data/lsht.jsonl"] == from_folder.data_sources()["longbench/data/lsht.jsonl"]
    assert sources["longbench/data.zip"] == hashlib.sha256(zip_path.read_bytes()).hexdigest()
    # A folder holding only data.zip works too; a wrong pinned hash is refused.
    assert len(list(task(datasets=["lsht"], data_dir=str(tmp_path)).samples())) == 3
    with pytest.raises(ValueError, match="configured sha256"):
        list(task(datasets=["lsht"], data_dir=str(zip_path), sha256="0" * 64).samples())
    # LongBench-E reads the `_e` members of the same zip.
    assert [s.id for s in task(datasets=["lcc"], data_dir=str(zip_path), longbench_e=True).samples()][-1] == "lcc/2"


def test_missing_file_names_the_paths(tmp_path):
    (tmp_path / "data").mkdir()
    with pytest.raises(FileNotFoundError, match="lcc.jsonl"):
        list(task(datasets=["lcc"], data_dir=str(tmp_path)).samples())
    import zipfile

    with zipfile.ZipFile(tmp_path / "partial.zip", "w") as archive:
        archive.writestr("data/lsht.jsonl", (FIXTURE / "data" / "lsht.jsonl").read_bytes())
    with pytest.raises(FileNotFoundError, match="data/lcc.jsonl"):
        list(task(datasets=["lcc"], data_dir=str(tmp_path / "partial.zip")).samples())


def test_download_trust_on_first_use(tmp_path, monkeypatch):
    import huggingface_hub

    zip_source = fixture_builder.write_zip(FIXTURE, tmp_path / "upstream.zip")
    digest = hashlib.sha256(zip_source.read_bytes()).hexdigest()
    calls = []

    def fake_download(repo_id, filename, repo_type, local_dir):
        calls.append((repo_id, filename, repo_type))
        shutil.copy(zip_source, Path(local_dir) / filename)
        return str(Path(local_dir) / filename)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    cache = tmp_path / "cache"
    t = lb.LongBench(datasets=["trec"], cache_dir=str(cache))
    assert len(list(t.samples())) == 3
    assert calls == [("THUDM/LongBench", "data.zip", "dataset")]
    manifest = json.loads((cache / "data.zip.manifest.json").read_text())
    assert manifest["sha256"] == digest and t.data_sources()["longbench/data.zip"] == digest
    # Later uses verify against the manifest and never download again.
    assert len(list(lb.LongBench(datasets=["trec"], cache_dir=str(cache)).samples())) == 3
    assert len(calls) == 1
    # A pinned hash is checked as well.
    with pytest.raises(ValueError, match="configured sha256"):
        list(lb.LongBench(datasets=["trec"], cache_dir=str(cache), sha256="f" * 64).samples())
    # A changed cached copy is refused, not replaced.
    with open(cache / "data.zip", "ab") as handle:
        handle.write(b"tampered")
    with pytest.raises(ValueError, match="recorded"):
        list(lb.LongBench(datasets=["trec"], cache_dir=str(cache)).samples())
    assert len(calls) == 1


def test_fixture_is_reproducible_and_small(tmp_path, capsys):
    fixture_builder.main(["--out", str(tmp_path)])  # the command line writes what is committed
    assert f"wrote {21 + 13} files" in capsys.readouterr().out
    written = sorted(p.name for p in (tmp_path / "data").iterdir())
    committed = sorted(p.name for p in (FIXTURE / "data").iterdir())
    assert written == committed and len(written) == 21 + 13
    for name in written:
        assert (tmp_path / "data" / name).read_bytes() == (FIXTURE / "data" / name).read_bytes(), name
    assert sum(p.stat().st_size for p in (FIXTURE / "data").iterdir()) < 200_000
    for name in written:
        for record in records(name[: -len(".jsonl")]):
            assert set(record) == {"input", "context", "answers", "length", "dataset", "language", "all_classes", "_id"}
    assert len(list(task(datasets=list(lb.ALL_21)).samples())) == 63  # every file loads as the task reads it
    assert len(list(task(datasets=list(lb.LONGBENCH_E_13), longbench_e=True).samples())) == 39


def test_chat_prompt_untruncated(tokenizer):
    t = task(datasets=["narrativeqa"])
    sample = sample_of(t, "narrativeqa/0")
    record = records("narrativeqa")[0]
    text = lb.DATASET2PROMPT["narrativeqa"].format(**record)
    assert text.startswith("You are given a story") and record["context"] in text and record["input"] in text
    prompt = t.build_prompt(sample, tokenizer, max_length=None)
    # BOS + bytes of "[USER]" + text + "[BOT]"
    assert prompt.input_ids == [tokenizer.bos_token_id] + byte_ids(tokenizer, "[USER]" + text + "[BOT]")
    assert prompt.info == {"dataset": "narrativeqa", "truncated": False, "length": record["length"], "language": "en",
                           "chat_template": True}
    assert prompt.generation.max_new_tokens == 128 and prompt.generation.do_sample is False
    assert prompt.generation.stop_token_ids == () and prompt.generation.min_new_tokens == 0


@pytest.mark.parametrize("dataset, chat_template, template_in_tokenizer", [
    ("trec", True, True), ("lsht", True, True), ("repobench-p", True, True),  # NO_CHAT_DATASETS
    ("narrativeqa", False, True), ("qasper", True, False),  # switched off; a tokenizer without a template
])
def test_bos_and_text_without_a_chat_template(tokenizer, dataset, chat_template, template_in_tokenizer):
    t = task(datasets=[dataset], chat_template=chat_template)
    plain = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend_tokenizer, bos_token="<bos>", eos_token="<eos>")
    sample = sample_of(t, f"{dataset}/0")
    text = lb.DATASET2PROMPT[dataset].format(**sample.fields["record"])
    prompt = t.build_prompt(sample, tokenizer if template_in_tokenizer else plain, max_length=None)
    assert prompt.input_ids == [0] + byte_ids(tokenizer, text) and prompt.info["chat_template"] is False


def test_middle_truncation_counts_bos_then_chat(tokenizer):
    t = task(datasets=["narrativeqa"])
    sample = sample_of(t, "narrativeqa/1")  # the long record
    text = lb.DATASET2PROMPT["narrativeqa"].format(**sample.fields["record"])
    assert text.isascii()  # one byte per character, so string slices equal token slices
    n = len(text) + 1  # tokens with BOS
    # Exactly n tokens is not "more than" n: untouched.
    assert t.build_prompt(sample, tokenizer, max_length=n).info["truncated"] is False
    # max_length 101: half = int(101/2) = 50; head = decode(ids[:50]) = BOS (skipped) + 49 chars,
    # tail = the last 50 chars; the chat template is applied to the joined string afterwards.
    prompt = t.build_prompt(sample, tokenizer, max_length=101)
    cut = text[:49] + text[-50:]
    assert prompt.info["truncated"] is True
    assert prompt.input_ids == [0] + byte_ids(tokenizer, "[USER]" + cut + "[BOT]")
    assert len(prompt.input_ids) == 1 + 6 + 99 + 5  # BOS + "[USER]" + 99 chars + "[BOT]"
    # One token over the limit (n > n-1) truncates: half = int((n-1)/2).
    half = int((n - 1) / 2)
    assert lb.truncate_middle(text, tokenizer, n - 1) == (text[: half - 1] + text[-half:], True)


def test_truncation_of_no_chat_dataset(tokenizer):
    t = task(datasets=["lcc"])
    sample = sample_of(t, "lcc/1")
    text = lb.DATASET2PROMPT["lcc"].format(**sample.fields["record"])
    prompt = t.build_prompt(sample, tokenizer, max_length=64)
    # half = 32: BOS + 31 chars, then the last 32 chars; re-encoded with BOS.
    assert prompt.input_ids == [0] + byte_ids(tokenizer, text[:31] + text[-32:])
    assert prompt.info["truncated"] is True and prompt.generation.max_new_tokens == 64


def test_samsum_generation_settings(tokenizer):
    t = task(datasets=["samsum"])
    prompt = t.build_prompt(sample_of(t, "samsum/0"), tokenizer, max_length=None)
    newline_id = tokenizer.encode("\n", add_special_tokens=False)[-1]
    assert newline_id == tokenizer.convert_tokens_to_ids("Ċ")  # byte 0x0A
    assert prompt.generation.stop_token_ids == (newline_id,)
    assert prompt.generation.min_new_tokens == 1 and prompt.generation.max_new_tokens == 128
    assert prompt.info["chat_template"] is False


def test_score_uses_dataset_metric_and_classes():
    t = task(datasets=["trec", "passage_retrieval_zh", "lcc"])
    samples = {s.id: s for s in t.samples()}
    assert t.score(samples["trec/0"], "City\nType: Date") == {"score": 1.0}  # first line only
    assert t.score(samples["passage_retrieval_zh/0"], "段落3") == {"score": 1.0}
    gold = samples["lcc/0"].fields["record"]["answers"][0]
    assert t.score(samples["lcc/0"], "\n" + gold + "\nmore") == {"score": 1.0}


def _rows(t: lb.LongBench, predict) -> list[dict]:
    rows = []
    for sample in t.samples():
        record = sample.fields["record"]
        info = {"dataset": sample.fields["dataset"], "length": record["length"]}
        rows.append({"sample_id": sample.id, "scores": t.score(sample, predict(sample)), "info": info})
    return rows


def test_summarize_official_scores_and_average():
    t = task(datasets=["narrativeqa", "passage_count", "trec"])

    def predict(sample):  # right except index 2 of narrativeqa and trec
        right = sample.fields["record"]["answers"][0]
        return "zzz" if sample.id in ("narrativeqa/2", "trec/2") else right

    rows = _rows(t, predict)
    summary = t.summarize(list(reversed(rows)))  # row order does not matter
    # narrativeqa and trec: 2 of 3 -> round(100*2/3, 2) = 66.67; passage_count 3 of 3 -> 100.0
    assert summary["datasets"] == {"narrativeqa": 66.67, "passage_count": 100.0, "trec": 66.67}
    assert list(summary["datasets"]) == ["narrativeqa", "passage_count", "trec"]  # configured order
    assert summary["average"] == pytest.approx((66.67 + 100.0 + 66.67) / 3)
    assert summary["num_samples"] == {"narrativeqa": 3, "passage_count": 3, "trec": 3}
    assert summary["metric_environment"]["fuzzy_backend"] == "difflib"
    assert "length_buckets" not in summary


def test_summarize_longbench_e_buckets():
    t = task(datasets=["qasper", "trec"], longbench_e=True)

    def predict(sample):  # qasper/1 (length 4000) wrong
        return "zzz" if sample.id == "qasper/1" else sample.fields["record"]["answers"][0]

    summary = t.summarize(_rows(t, predict))
    # lengths 3999 / 4000 / 8000 -> one sample per bucket
    assert summary["length_buckets"]["qasper"] == {"0-4k": 100.0, "4-8k": 0.0, "8k+": 100.0}
    assert summary["length_buckets"]["trec"] == {"0-4k": 100.0, "4-8k": 100.0, "8k+": 100.0}
    assert summary["length_bucket_average"] == {"0-4k": 100.0, "4-8k": 50.0, "8k+": 100.0}
    assert summary["datasets"] == {"qasper": 66.67, "trec": 100.0}
    # With limit 2 the 8k+ bucket is empty: NaN, as officially.
    t2 = task(datasets=["qasper"], longbench_e=True, limit=2)
    buckets = t2.summarize(_rows(t2, lambda s: s.fields["record"]["answers"][0]))["length_buckets"]["qasper"]
    assert buckets["0-4k"] == 100.0 and math.isnan(buckets["8k+"])


@pytest.mark.parametrize(("config", "expected", "is_e"), [
    ("longbench", lb.ENGLISH_16, False),
    ("longbench_full", lb.ALL_21, False),
    ("longbench_e", lb.LONGBENCH_E_13, True),
])
def test_hydra_configs_instantiate(config, expected, is_e):
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(ROOT / "conf" / "task" / f"{config}.yaml")
    assert "name" in cfg and "limit" in cfg and cfg.name == config
    cfg.data_dir = str(FIXTURE)
    t = instantiate(cfg)
    assert isinstance(t, lb.LongBench) and type(t.datasets) is list
    assert tuple(t.datasets) == expected and t.longbench_e is is_e
    t.validate()


def test_summarize_prompt_length_bins_and_compression_ratio():
    t = task(datasets=["narrativeqa", "trec"])
    rows = _rows(t, lambda s: "x")
    # Prompt lengths and ratios as the runner writes them (budget N = 2048, ratio = min(N / L, 1)).
    lengths = {"narrativeqa/0": 2048, "narrativeqa/1": 2049, "narrativeqa/2": 9000,
               "trec/0": 100, "trec/1": 6144, "trec/2": 8192}
    for row in rows:
        row["prompt_tokens"] = lengths[row["sample_id"]]
        row["compression_ratio"] = min(2048 / row["prompt_tokens"], 1.0)
    summary = t.summarize(rows)
    assert summary["prompt_length_bins"]["narrativeqa"] == {"<=2K": 1, "2K-4K": 1, "4K-6K": 0, "6K-8K": 0, ">8K": 1}
    assert summary["prompt_length_bins"]["trec"] == {"<=2K": 1, "2K-4K": 0, "4K-6K": 1, "6K-8K": 1, ">8K": 0}
    narrative = (1 + 2048 / 2049 + 2048 / 9000) / 3
    trec = (1 + 2048 / 6144 + 2048 / 8192) / 3
    assert summary["compression_ratio"]["narrativeqa"] == pytest.approx(narrative)
    assert summary["compression_ratio"]["average"] == pytest.approx((narrative + trec) / 2)
    assert summary["mean_prompt_tokens"]["trec"] == pytest.approx((100 + 6144 + 8192) / 3)


def test_failed_download_names_the_offline_alternative(tmp_path, monkeypatch):
    import huggingface_hub

    def offline(**kwargs):
        raise OSError("no route to host")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", offline)
    with pytest.raises(RuntimeError, match="point task.data_dir at it"):
        list(lb.LongBench(datasets=["trec"], cache_dir=str(tmp_path / "cache")).samples())
