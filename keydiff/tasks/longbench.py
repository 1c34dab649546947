"""LongBench v1 (and LongBench-E), following the official `LongBench/pred.py` and `eval.py` exactly.

Design: docs/design/tasks.md#longbench
"""

# The prompt templates below are one string per line on purpose: they are data copied verbatim.
# ruff: noqa: E501

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar, Iterator

import numpy as np

from keydiff.tasks import longbench_metrics as metrics
from keydiff.tasks.base import (GenerationSettings, Prompt, Sample, Task, encode_user_turn, locate, render_user_turn,
                                 split_encode)

logger = logging.getLogger(__name__)

HF_REPO_ID = "THUDM/LongBench"
HF_FILENAME = "data.zip"
DEFAULT_CACHE_DIR = "~/.cache/keydiff-bench/longbench"


@dataclass(frozen=True)
class DatasetSpec:
    """One row of the official configuration (dataset2prompt/maxlen/metric plus pred.py's special cases)."""

    name: str
    language: str  # "en", "zh" or "code", LongBench's grouping
    metric: Callable[..., float]
    max_new_tokens: int
    chat: bool  # pred.py wraps the prompt in the model's chat template
    first_line: bool  # eval.py scores only the first line of the prediction


_SPECS = (
    DatasetSpec("narrativeqa", "en", metrics.qa_f1_score, 128, True, False),
    DatasetSpec("qasper", "en", metrics.qa_f1_score, 128, True, False),
    DatasetSpec("multifieldqa_en", "en", metrics.qa_f1_score, 64, True, False),
    DatasetSpec("multifieldqa_zh", "zh", metrics.qa_f1_zh_score, 64, True, False),
    DatasetSpec("hotpotqa", "en", metrics.qa_f1_score, 32, True, False),
    DatasetSpec("2wikimqa", "en", metrics.qa_f1_score, 32, True, False),
    DatasetSpec("musique", "en", metrics.qa_f1_score, 32, True, False),
    DatasetSpec("dureader", "zh", metrics.rouge_zh_score, 128, True, False),
    DatasetSpec("gov_report", "en", metrics.rouge_score, 512, True, False),
    DatasetSpec("qmsum", "en", metrics.rouge_score, 512, True, False),
    DatasetSpec("multi_news", "en", metrics.rouge_score, 512, True, False),
    DatasetSpec("vcsum", "zh", metrics.rouge_zh_score, 512, True, False),
    DatasetSpec("trec", "en", metrics.classification_score, 64, False, True),
    DatasetSpec("triviaqa", "en", metrics.qa_f1_score, 32, False, True),
    DatasetSpec("samsum", "en", metrics.rouge_score, 128, False, True),
    DatasetSpec("lsht", "zh", metrics.classification_score, 64, False, True),
    DatasetSpec("passage_count", "en", metrics.count_score, 32, True, False),
    DatasetSpec("passage_retrieval_en", "en", metrics.retrieval_score, 32, True, False),
    DatasetSpec("passage_retrieval_zh", "zh", metrics.retrieval_zh_score, 32, True, False),
    DatasetSpec("lcc", "code", metrics.code_sim_score, 64, False, False),
    DatasetSpec("repobench-p", "code", metrics.code_sim_score, 64, False, False),
)
DATASETS: dict[str, DatasetSpec] = {spec.name: spec for spec in _SPECS}

# Presets. ALL_21 is the official order (and Table 11); ENGLISH_16 is KVCache-Factory's order, the
# English+code subset of the paper's Table 1; LONGBENCH_E_13 are the datasets with `<name>_e` files.
ALL_21: tuple[str, ...] = tuple(DATASETS)
ENGLISH_16: tuple[str, ...] = (
    "narrativeqa", "qasper", "multifieldqa_en", "hotpotqa", "2wikimqa", "musique",
    "gov_report", "qmsum", "multi_news", "trec", "triviaqa", "samsum",
    "passage_count", "passage_retrieval_en", "lcc", "repobench-p",
)  # fmt: skip
LONGBENCH_E_13: tuple[str, ...] = (
    "qasper", "multifieldqa_en", "hotpotqa", "2wikimqa", "gov_report", "multi_news",
    "trec", "triviaqa", "samsum", "passage_count", "passage_retrieval_en", "lcc", "repobench-p",
)  # fmt: skip

DATASET2MAXLEN: dict[str, int] = {name: spec.max_new_tokens for name, spec in DATASETS.items()}
NO_CHAT_DATASETS: frozenset[str] = frozenset(name for name, spec in DATASETS.items() if not spec.chat)
FIRST_LINE_DATASETS: frozenset[str] = frozenset(name for name, spec in DATASETS.items() if spec.first_line)

# `LongBench/config/dataset2prompt.json`, verbatim (typos and trailing spaces included).
DATASET2PROMPT: dict[str, str] = {
    "narrativeqa": "You are given a story, which can be either a novel or a movie script, and a question. Answer the question asconcisely as you can, using a single phrase if possible. Do not provide any explanation.\n\nStory: {context}\n\nNow, answer the question based on the story asconcisely as you can, using a single phrase if possible. Do not provide any explanation.\n\nQuestion: {input}\n\nAnswer:",
    "qasper": "You are given a scientific article and a question. Answer the question as concisely as you can, using a single phrase or sentence if possible. If the question cannot be answered based on the information in the article, write \"unanswerable\". If the question is a yes/no question, answer \"yes\", \"no\", or \"unanswerable\". Do not provide any explanation.\n\nArticle: {context}\n\n Answer the question based on the above article as concisely as you can, using a single phrase or sentence if possible. If the question cannot be answered based on the information in the article, write \"unanswerable\". If the question is a yes/no question, answer \"yes\", \"no\", or \"unanswerable\". Do not provide any explanation.\n\nQuestion: {input}\n\nAnswer:",
    "multifieldqa_en": "Read the following text and answer briefly.\n\n{context}\n\nNow, answer the following question based on the above text, only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:",
    "multifieldqa_zh": "阅读以下文字并用中文简短回答：\n\n{context}\n\n现在请基于上面的文章回答下面的问题，只告诉我答案，不要输出任何其他字词。\n\n问题：{input}\n回答：",
    "hotpotqa": "Answer the question based on the given passages. Only give me the answer and do not output any other words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the given passages. Only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:",
    "2wikimqa": "Answer the question based on the given passages. Only give me the answer and do not output any other words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the given passages. Only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:",
    "musique": "Answer the question based on the given passages. Only give me the answer and do not output any other words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the given passages. Only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:",
    "dureader": "请基于给定的文章回答下述问题。\n\n文章：{context}\n\n请基于上述文章回答下面的问题。\n\n问题：{input}\n回答：",
    "gov_report": "You are given a report by a government agency. Write a one-page summary of the report.\n\nReport:\n{context}\n\nNow, write a one-page summary of the report.\n\nSummary:",
    "qmsum": "You are given a meeting transcript and a query containing a question or instruction. Answer the query in one or more sentences.\n\nTranscript:\n{context}\n\nNow, answer the query based on the above meeting transcript in one or more sentences.\n\nQuery: {input}\nAnswer:",
    "multi_news": "You are given several news passages. Write a one-page summary of all news. \n\nNews:\n{context}\n\nNow, write a one-page summary of all the news.\n\nSummary:",
    "vcsum": "下面有一段会议记录，请你阅读后，写一段总结，总结会议的内容。\n会议记录：\n{context}\n\n会议总结：",
    "trec": "Please determine the type of the question below. Here are some examples of questions.\n\n{context}\n{input}",
    "triviaqa": "Answer the question based on the given passage. Only give me the answer and do not output any other words. The following are some examples.\n\n{context}\n\n{input}",
    "samsum": "Summarize the dialogue into a few short sentences. The following are some examples.\n\n{context}\n\n{input}",
    "lsht": "请判断给定新闻的类别，下面是一些例子。\n\n{context}\n{input}",
    "passage_count": "There are some paragraphs below sourced from Wikipedia. Some of them may be duplicates. Please carefully read these paragraphs and determine how many unique paragraphs there are after removing duplicates. In other words, how many non-repeating paragraphs are there in total?\n\n{context}\n\nPlease enter the final count of unique paragraphs after removing duplicates. The output format should only contain the number, such as 1, 2, 3, and so on.\n\nThe final answer is: ",
    "passage_retrieval_en": "Here are 30 paragraphs from Wikipedia, along with an abstract. Please determine which paragraph the abstract is from.\n\n{context}\n\nThe following is an abstract.\n\n{input}\n\nPlease enter the number of the paragraph that the abstract is from. The answer format must be like \"Paragraph 1\", \"Paragraph 2\", etc.\n\nThe answer is: ",
    "passage_retrieval_zh": "以下是若干段落文字，以及其中一个段落的摘要。请确定给定的摘要出自哪一段。\n\n{context}\n\n下面是一个摘要\n\n{input}\n\n请输入摘要所属段落的编号。答案格式必须是\"段落1\"，\"段落2\"等格式\n\n答案是：",
    "lcc": "Please complete the code given below. \n{context}Next line of code:\n",
    "repobench-p": "Please complete the code given below. \n{context}{input}Next line of code:\n",
}

# Where each template's question part starts (query_aware=false): the text before it is the context, compressed;
# from it on (question, instruction after the context, answer prefix) is fed after the compressed context. The
# place is kvpress's (`evaluation/benchmarks/longbench/create_huggingface_dataset.py`: the end of its
# `context_prefix`, the start of its `question_template`), found in the official template: the last occurrence.
QUESTION_STARTS: dict[str, str] = {
    "narrativeqa": "Question: {input}", "qasper": "Question: {input}", "multifieldqa_en": "Question: {input}",
    "multifieldqa_zh": "问题：{input}", "hotpotqa": "Question: {input}", "2wikimqa": "Question: {input}",
    "musique": "Question: {input}", "dureader": "问题：{input}",
    "gov_report": "Now, write a one-page summary of the report.", "qmsum": "Query: {input}",
    "multi_news": "Now, write a one-page summary of all the news.", "vcsum": "会议总结：",
    "trec": "{input}", "triviaqa": "{input}", "samsum": "{input}", "lsht": "{input}",
    "passage_count": "Please enter the final count", "passage_retrieval_en": "{input}",
    "passage_retrieval_zh": "{input}", "lcc": "Next line of code:", "repobench-p": "{input}",
}


def question_part(dataset: str, record: dict[str, Any]) -> str:
    """The filled template from its question part on (QUESTION_STARTS): what query_aware=false does not compress."""
    template = DATASET2PROMPT[dataset]
    return template[template.rindex(QUESTION_STARTS[dataset]):].format(**record)


def dataset_spec(dataset: str) -> DatasetSpec:
    """The spec of a v1 dataset name; ValueError naming the valid names otherwise."""
    try:
        return DATASETS[dataset]
    except KeyError:
        raise ValueError(f"unknown LongBench dataset {dataset!r}; valid datasets: {', '.join(ALL_21)}") from None




def score_sample(
    dataset: str,
    prediction: str,
    answers: list[str],
    all_classes: list[str] | None = None,
    *,
    fuzzy_backend: str = "difflib",
) -> float:
    """Per-sample score in [0, 1] as official `eval.py`: optional first-line cut, then max over answers."""
    spec = dataset_spec(dataset)
    if spec.metric is metrics.classification_score and all_classes is None:
        raise ValueError(f"{dataset} is scored by classification and needs all_classes")
    if spec.first_line:
        prediction = prediction.lstrip("\n").split("\n")[0]
    score = 0.0
    for ground_truth in answers:
        score = max(score, spec.metric(prediction, ground_truth, all_classes=all_classes, fuzzy_backend=fuzzy_backend))
    return float(score)


def aggregate(scores: list[float]) -> float:
    """Official dataset score: `round(100 * total / n, 2)`, summing in order, with Python's `round`."""
    if not scores:
        raise ValueError("no scores to aggregate")
    total = 0.0
    for score in scores:
        total += score
    return round(100 * total / len(scores), 2)


LENGTH_BUCKETS = ("0-4k", "4-8k", "8k+")


def length_bucket(length: int) -> str:
    """LongBench-E bucket of a record's `length` field (words, or characters for Chinese)."""
    if length < 4000:
        return "0-4k"
    if length < 8000:
        return "4-8k"
    return "8k+"


def aggregate_by_length(scores: list[float], lengths: list[int]) -> dict[str, float]:
    """Official `scorer_e`: per bucket `round(100 * np.mean(bucket), 2)` (numpy's mean and round); empty -> NaN."""
    if len(scores) != len(lengths):
        raise ValueError(f"{len(scores)} scores but {len(lengths)} lengths")
    buckets: dict[str, list[float]] = {name: [] for name in LENGTH_BUCKETS}
    for score, length in zip(scores, lengths):
        buckets[length_bucket(length)].append(score)
    result = {}
    for name, bucket in buckets.items():
        if bucket:
            result[name] = float(round(100 * np.mean(bucket), 2))  # np.float64.__round__, as officially
        else:
            result[name] = math.nan  # np.mean([]) is NaN (with a RuntimeWarning) officially
    return result


def _check_lengths(predictions: list[str], answers: list[list[str]]) -> None:
    if len(predictions) != len(answers):
        raise ValueError(f"{len(predictions)} predictions but {len(answers)} answer lists")


def score_dataset(
    dataset: str,
    predictions: list[str],
    answers: list[list[str]],
    all_classes: list[str] | None = None,
    *,
    fuzzy_backend: str = "difflib",
) -> float:
    """Official `scorer`: the dataset score in percent, rounded to 2 decimals."""
    _check_lengths(predictions, answers)
    return aggregate(
        [score_sample(dataset, p, a, all_classes, fuzzy_backend=fuzzy_backend) for p, a in zip(predictions, answers)]
    )


def score_dataset_by_length(
    dataset: str,
    predictions: list[str],
    answers: list[list[str]],
    lengths: list[int],
    all_classes: list[str] | None = None,
    *,
    fuzzy_backend: str = "difflib",
) -> dict[str, float]:
    """Official `scorer_e`: scores per `length` bucket "0-4k", "4-8k", "8k+"."""
    _check_lengths(predictions, answers)
    scores = [
        score_sample(dataset, p, a, all_classes, fuzzy_backend=fuzzy_backend) for p, a in zip(predictions, answers)
    ]
    return aggregate_by_length(scores, lengths)




def _sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


@dataclass(frozen=True)
class _DataSource:
    """Where the jsonl files are: a folder (`<dir>/data/<file>.jsonl` or `<dir>/<file>.jsonl`) or a zip."""

    path: Path
    is_zip: bool

    def read(self, stem: str) -> tuple[str, bytes]:
        """(name recorded in data_sources, raw bytes) of `<stem>.jsonl`."""
        candidates = [f"data/{stem}.jsonl", f"{stem}.jsonl"]
        if self.is_zip:
            with zipfile.ZipFile(self.path) as archive:
                names = set(archive.namelist())
                for candidate in candidates:
                    if candidate in names:
                        return candidate, archive.read(candidate)
            raise FileNotFoundError(f"{self.path} holds none of {candidates}")
        for candidate in candidates:
            if (self.path / candidate).is_file():
                return candidate, (self.path / candidate).read_bytes()
        raise FileNotFoundError(f"none of {[str(self.path / c) for c in candidates]} exists")


def _parse_jsonl(raw: bytes) -> list[dict[str, Any]]:
    # Split on "\n" only: str.splitlines would also split at U+2028 etc. inside JSON strings.
    return [json.loads(line) for line in raw.decode("utf-8").split("\n") if line.strip()]


def _download_data_zip(cache_dir: Path) -> None:
    """Fetch `data.zip` from the HF Hub into `cache_dir` (imported lazily: offline use never needs it)."""
    from huggingface_hub import hf_hub_download

    logger.info("downloading %s/%s into %s", HF_REPO_ID, HF_FILENAME, cache_dir)
    try:
        hf_hub_download(repo_id=HF_REPO_ID, filename=HF_FILENAME, repo_type="dataset", local_dir=str(cache_dir))
    except Exception as error:  # network, auth or hub errors all end the same way for the user
        raise RuntimeError(
            f"could not download {HF_FILENAME} of the dataset {HF_REPO_ID} ({type(error).__name__}: {error}). "
            f"Without network access, fetch data.zip elsewhere and point task.data_dir at it "
            f"(the zip, or the folder of extracted jsonl files)"
        ) from error




@dataclass
class LongBench(Task):
    """LongBench v1 (or LongBench-E with `longbench_e`) over the chosen datasets. `data_dir` (official jsonl files or
    `data.zip`) is read offline; else `data.zip` is downloaded once into `cache_dir`, its sha256 written to a
    manifest (trust on first use) and checked on every later use; `sha256` pins the hash."""

    name: str = "longbench"
    datasets: list[str] = field(default_factory=lambda: list(ENGLISH_16))
    longbench_e: bool = False
    data_dir: str | None = None
    cache_dir: str = DEFAULT_CACHE_DIR
    sha256: str | None = None
    limit: int | None = None
    fuzzy_backend: str = "difflib"
    chat_template: bool = True
    _data_sources: dict[str, str] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        # Hydra hands over a ListConfig; a single name is accepted as a one-item list.
        self.datasets = [self.datasets] if isinstance(self.datasets, str) else [str(d) for d in self.datasets]


    def valid_datasets(self) -> tuple[str, ...]:
        return LONGBENCH_E_13 if self.longbench_e else ALL_21

    def validate(self) -> None:
        valid = self.valid_datasets()
        suite = "LongBench-E" if self.longbench_e else "LongBench"
        if not self.datasets:
            raise ValueError(f"no datasets chosen; valid {suite} datasets: {', '.join(valid)}")
        unknown = [d for d in self.datasets if d not in valid]
        if unknown:
            raise ValueError(f"unknown {suite} dataset(s) {unknown}; valid {suite} datasets: {', '.join(valid)}")
        repeated = sorted({d for d in self.datasets if self.datasets.count(d) > 1})
        if repeated:
            raise ValueError(f"datasets listed more than once: {repeated}")
        metrics.check_fuzzy_backend(self.fuzzy_backend)
        if self.limit is not None and (not isinstance(self.limit, int) or self.limit < 1):
            raise ValueError(f"limit must be a positive integer or null (all samples), got {self.limit!r}")
        if self.sha256 is not None and not re.fullmatch(r"[0-9a-f]{64}", self.sha256):
            raise ValueError(f"sha256 must be 64 lower-case hex digits or null, got {self.sha256!r}")
        if self.data_dir is not None and not Path(self.data_dir).expanduser().exists():
            raise ValueError(f"data_dir {self.data_dir!r} does not exist (give a folder of jsonl files or data.zip)")

    def metric_info(self) -> dict[str, str]:
        """Package versions and the fuzzy backend behind the scores, for the run's metadata."""
        return metrics.metric_environment(self.fuzzy_backend)


    def hub_downloads(self) -> list[str]:
        if self.data_dir is not None or (Path(self.cache_dir).expanduser() / HF_FILENAME).is_file():
            return []
        return [f"LongBench's {HF_FILENAME} from {HF_REPO_ID} (offline: task.data_dir=<data.zip or a folder of its jsonl "
                f"files>, or data.zip copied to {Path(self.cache_dir).expanduser()})"]

    def _file_stem(self, dataset: str) -> str:
        return f"{dataset}_e" if self.longbench_e else dataset

    def _source(self) -> _DataSource:
        if self.data_dir is None:
            return _DataSource(self._cached_zip(), is_zip=True)
        path = Path(self.data_dir).expanduser()
        if path.is_dir() and not (path / "data").is_dir() and (path / HF_FILENAME).is_file():
            path = path / HF_FILENAME
        if path.is_file():
            if path.suffix != ".zip":
                raise ValueError(f"data_dir must be a folder or a .zip file, got {path}")
            self._record_zip(path, self._check_pinned(path))
            return _DataSource(path, is_zip=True)
        return _DataSource(path, is_zip=False)

    def _check_pinned(self, zip_path: Path) -> str:
        digest = _sha256_file(zip_path)
        if self.sha256 is not None and digest != self.sha256:
            raise ValueError(f"{zip_path} has sha256 {digest}, but the configured sha256 is {self.sha256}")
        return digest

    def _record_zip(self, zip_path: Path, digest: str) -> None:
        self._data_sources[f"longbench/{zip_path.name}"] = digest

    def _cached_zip(self) -> Path:
        """The cached `data.zip`: downloaded only when absent, never over an existing copy."""
        cache_dir = Path(self.cache_dir).expanduser()
        zip_path = cache_dir / HF_FILENAME
        manifest_path = cache_dir / f"{HF_FILENAME}.manifest.json"
        if not zip_path.is_file():
            cache_dir.mkdir(parents=True, exist_ok=True)
            _download_data_zip(cache_dir)
            if not zip_path.is_file():
                raise FileNotFoundError(f"download finished but {zip_path} is missing")
        digest = self._check_pinned(zip_path)
        if manifest_path.is_file():
            recorded = json.loads(manifest_path.read_text())["sha256"]
            if digest != recorded:
                raise ValueError(
                    f"{zip_path} has sha256 {digest} but {manifest_path} recorded {recorded} on first use; "
                    "the cached copy changed. Delete both files to download again, or set data_dir."
                )
        else:
            manifest = {"repo_id": HF_REPO_ID, "filename": HF_FILENAME, "repo_type": "dataset", "sha256": digest}
            tmp = manifest_path.with_suffix(".tmp")
            tmp.write_text(json.dumps(manifest, indent=2) + "\n")
            os.replace(tmp, manifest_path)
            logger.info("recorded sha256 %s of %s (trust on first use)", digest, zip_path)
        self._record_zip(zip_path, digest)
        return zip_path

    def _load(self, source: _DataSource, dataset: str) -> list[dict[str, Any]]:
        member, raw = source.read(self._file_stem(dataset))
        self._data_sources[f"longbench/{member}"] = _sha256_bytes(raw)
        return _parse_jsonl(raw)

    def samples(self) -> Iterator[Sample]:
        self.validate()
        source = self._source()
        for dataset in self.datasets:
            records = self._load(source, dataset)
            # Official eval.py scores every sample with the all_classes of the last line it read.
            classes = records[-1].get("all_classes") if records else None
            if any(record.get("all_classes") != classes for record in records):
                logger.warning("%s: all_classes differ between records; using the last record's, as eval.py", dataset)
            for index, record in enumerate(records[: self.limit]):
                yield Sample(
                    id=f"{dataset}/{index}",
                    fields={"dataset": dataset, "index": index, "record": record, "all_classes": classes},
                )

    def data_sources(self) -> dict[str, str]:
        """sha256 of every jsonl file read (and of data.zip when the files came from it)."""
        read = {key.rsplit("/", 1)[1] for key in self._data_sources}
        missing = [d for d in self.datasets if f"{self._file_stem(d)}.jsonl" not in read]
        if missing:
            self.validate()
            source = self._source()
            for dataset in missing:
                self._load(source, dataset)
        return dict(sorted(self._data_sources.items()))


    context_split: ClassVar[str | None] = ("per dataset template, where kvpress's question part starts "
                                           "(QUESTION_STARTS: e.g. \"Question: {input}\", gov_report's \"Now, write\")")

    def build_prompt(self, sample: Sample, tokenizer: Any, max_length: int | None, query_aware: bool = True) -> Prompt:
        dataset: str = sample.fields["dataset"]
        record: dict[str, Any] = sample.fields["record"]
        spec = dataset_spec(dataset)
        prompt, truncated = truncate_middle(DATASET2PROMPT[dataset].format(**record), tokenizer, max_length)
        chat = self.chat_template and spec.chat
        input_ids = encode_user_turn(tokenizer, prompt, chat=chat)
        context_tokens = None
        if not query_aware:
            # The question part is the prompt's end (the middle cut leaves the end whole unless the question is
            # longer than half of max_length: then what survived of it).
            question = question_part(dataset, record)
            kept = next(n for n in range(min(len(question), len(prompt)), -1, -1) if prompt.endswith(question[len(question) - n:]))
            rendered, add_special = render_user_turn(tokenizer, prompt, chat=chat)
            split = locate(rendered, prompt, f"LongBench {dataset}") + len(prompt) - kept
            input_ids, context_tokens = split_encode(tokenizer, rendered, split, add_special)
        generation = GenerationSettings(max_new_tokens=spec.max_new_tokens)
        if dataset == "samsum":
            # pred.py: min_length=context_length+1 and the newline token as an extra EOS.
            generation.min_new_tokens = 1
            generation.stop_token_ids = (tokenizer.encode("\n", add_special_tokens=False)[-1],)
        info = {
            "dataset": dataset,
            "truncated": truncated,
            "length": record.get("length"),
            "language": record.get("language", spec.language),
            "chat_template": bool(chat and getattr(tokenizer, "chat_template", None)),
        }
        return Prompt(input_ids=input_ids, generation=generation, info=info, context_tokens=context_tokens)


    def score(self, sample: Sample, prediction: str) -> dict[str, float]:
        fields = sample.fields
        answers = fields["record"]["answers"]
        classes = fields["all_classes"]
        return {"score": score_sample(fields["dataset"], prediction, answers, classes, fuzzy_backend=self.fuzzy_backend)}

    def summarize(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        """Official per-dataset scores, their plain mean ("average", of the rounded scores, as papers
        average them), and for LongBench-E the per-length-bucket scores and their mean over datasets."""
        per_dataset: dict[str, list[tuple[int, float, int]]] = {}
        for row in rows:
            dataset = row["info"]["dataset"]
            index = int(str(row["sample_id"]).rsplit("/", 1)[1])
            per_dataset.setdefault(dataset, []).append((index, float(row["scores"]["score"]), row["info"]["length"]))
        order = [d for d in self.datasets if d in per_dataset] + sorted(set(per_dataset) - set(self.datasets))
        scores: dict[str, float] = {}
        buckets: dict[str, dict[str, float]] = {}
        for dataset in order:
            entries = sorted(per_dataset[dataset])  # file order, as the official single-GPU pred file
            scores[dataset] = aggregate([score for _, score, _ in entries])
            if self.longbench_e:
                buckets[dataset] = aggregate_by_length([s for _, s, _ in entries], [n for _, _, n in entries])
        summary: dict[str, Any] = {
            "average": sum(scores.values()) / len(scores) if scores else math.nan,
            "datasets": scores,
            "num_samples": {dataset: len(per_dataset[dataset]) for dataset in order},
            "metric_environment": self.metric_info(),
            **prompt_statistics(rows, order),
        }
        if self.longbench_e:
            summary["length_buckets"] = buckets
            summary["length_bucket_average"] = {
                name: sum(b[name] for b in buckets.values()) / len(buckets) if buckets else math.nan
                for name in LENGTH_BUCKETS
            }
        return summary


# Table 8's length bins, in tokens with K = 1024 as for the budgets: (0, 2K], (2K, 4K], (4K, 6K], (6K, 8K], > 8K.
PROMPT_LENGTH_BINS = (("<=2K", 2048), ("2K-4K", 4096), ("4K-6K", 6144), ("6K-8K", 8192), (">8K", math.inf))


def prompt_statistics(rows: list[dict[str, Any]], order: list[str]) -> dict[str, Any]:
    """Per dataset: prompt-token histogram (Table 8, Figure 18) and mean `kept_ratio` (older rows:
    `compression_ratio`; Table 9), rows without them skipped; the ratio "average" is over datasets, as Table 9's."""
    lengths: dict[str, list[int]] = {}
    ratios: dict[str, list[float]] = {}
    for row in rows:
        dataset = row["info"]["dataset"]
        if "prompt_tokens" in row:
            lengths.setdefault(dataset, []).append(int(row["prompt_tokens"]))
        kept = row.get("kept_ratio", row.get("compression_ratio"))
        if kept is not None:
            ratios.setdefault(dataset, []).append(float(kept))
    bins = {}
    for dataset in [d for d in order if d in lengths]:
        counts = {name: 0 for name, _ in PROMPT_LENGTH_BINS}
        for n in lengths[dataset]:
            counts[next(name for name, upper in PROMPT_LENGTH_BINS if n <= upper)] += 1
        bins[dataset] = counts
    mean_ratio = {d: sum(ratios[d]) / len(ratios[d]) for d in order if d in ratios}
    if mean_ratio:
        mean_ratio["average"] = sum(mean_ratio.values()) / len(mean_ratio)
    mean_tokens = {d: sum(lengths[d]) / len(lengths[d]) for d in order if d in lengths}
    return {"prompt_length_bins": bins, "mean_prompt_tokens": mean_tokens, "compression_ratio": mean_ratio}


def truncate_middle(prompt: str, tokenizer: Any, max_length: int | None) -> tuple[str, bool]:
    """pred.py's middle truncation: if the prompt has more than `max_length` tokens (BOS included),
    keep the decoded first and last `int(max_length/2)` tokens, joined as strings."""
    if max_length is None:
        return prompt, False
    token_ids = list(tokenizer(prompt, truncation=False)["input_ids"])
    if len(token_ids) <= max_length:
        return prompt, False
    half = int(max_length / 2)
    head = tokenizer.decode(token_ids[:half], skip_special_tokens=True)
    tail = tokenizer.decode(token_ids[-half:], skip_special_tokens=True)
    return head + tail, True
