"""The LongBench task: templates, truncation, data loading, summaries. The byte-level tokenizer made here (one token
per UTF-8 byte, BOS prepended) makes every token count a byte count plus one."""

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


def test_zip_data_dir(tmp_path):
    zip_path = fixture_builder.write_zip(FIXTURE, tmp_path / "data.zip")
    from_zip = task(datasets=["lsht"], data_dir=str(zip_path))
    from_folder = task(datasets=["lsht"])
    assert [s.fields for s in from_zip.samples()] == [s.fields for s in from_folder.samples()]
    sources = from_zip.data_sources()
    assert sources["longbench/data/lsht.jsonl"] == from_folder.data_sources()["longbench/data/lsht.jsonl"]
    assert sources["longbench/data.zip"] == hashlib.sha256(zip_path.read_bytes()).hexdigest()
    assert len(list(task(datasets=["lsht"], data_dir=str(tmp_path)).samples())) == 3  # a folder holding only data.zip


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


def _rows(t: lb.LongBench, predict) -> list[dict]:
    rows = []
    for sample in t.samples():
        record = sample.fields["record"]
        info = {"dataset": sample.fields["dataset"], "length": record["length"]}
        rows.append({"sample_id": sample.id, "scores": t.score(sample, predict(sample)), "info": info})
    return rows


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
