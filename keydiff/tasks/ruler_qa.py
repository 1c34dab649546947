"""RULER's QA tasks: qa_1 on SQuAD, qa_2 on HotpotQA, from the official JSON files in `task.data_dir`, built as
RULER's qa.py builds them (gold documents plus shuffled distractors). The project's made-up fixture is
recognised by its sha256 and reported as such.

Design: docs/design/tasks.md#ruler
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from keydiff.tasks.ruler_generators import TEMPLATES, Generator, sub_seed

DATASET_FILES = {
    "squad": ("squad.json", "dev-v2.0.json", "dev-v1.1.json"),
    "hotpotqa": ("hotpotqa.json", "hotpot_dev_distractor_v1.json"),
}
DOCUMENT = "Document {i}:\n{document}"
# sha256 of tasks/fixtures/ruler/{squad,hotpotqa}.json (keydiff.tasks.fixture_builders.ruler), checked by the tests.
FIXTURE_SHA256 = frozenset({
    "730aacbb514650ff9d6feddcb6f83dfc5085f9bf38be860ea809a7d910d8e487",
    "9020f988a1f9255d7c1779feb9ef469c9990fa7b4e18b9df27f25a6714fb0417",
})


@dataclass(frozen=True)
class QAData:
    """Questions (query, answers, gold document ids, preferred distractor ids) over sorted unique documents."""

    questions: list[dict[str, Any]]
    documents: list[str]
    source: dict[str, str]
    is_fixture: bool = False  # the project's made-up fixture, not the official data set


def find_file(data_dir: str | Path, dataset: str) -> Path:
    folder = Path(data_dir).expanduser()
    for name in DATASET_FILES[dataset]:
        if (folder / name).is_file():
            return folder / name
    raise ValueError(
        f"task.data_dir={str(data_dir)!r} has no {dataset} file; expected one of {list(DATASET_FILES[dataset])}"
    )


def read_squad(data: dict[str, Any]) -> tuple[list[dict[str, Any]], list[str]]:
    documents = sorted({p["context"] for article in data["data"] for p in article["paragraphs"]})
    index = {doc: i for i, doc in enumerate(documents)}
    questions = []
    for article in data["data"]:
        article_docs = [index[p["context"]] for p in article["paragraphs"]]
        for paragraph in article["paragraphs"]:
            gold = index[paragraph["context"]]
            for qa in paragraph["qas"]:
                if qa.get("is_impossible", False):
                    continue
                questions.append({
                    "query": qa["question"],
                    "answers": [a["text"] for a in qa["answers"]],
                    "gold": [gold],
                    "more": [d for d in article_docs if d != gold],
                })
    return questions, documents


def read_hotpotqa(data: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[str]]:
    def doc(title: str, sentences: list[str]) -> str:
        return f"{title}\n{''.join(sentences)}"

    documents = sorted({doc(t, s) for record in data for t, s in record["context"]})
    index = {d: i for i, d in enumerate(documents)}
    questions = [
        {"query": r["question"], "answers": [r["answer"]], "gold": [index[doc(t, s)] for t, s in r["context"]], "more": []}
        for r in data
    ]
    return questions, documents


def load_qa(data_dir: str | Path, dataset: str) -> QAData:
    path = find_file(data_dir, dataset)
    raw = path.read_bytes()
    try:
        data = json.loads(raw)
        questions, documents = read_squad(data) if dataset == "squad" else read_hotpotqa(data)
    except (KeyError, TypeError, ValueError) as error:
        expected = "SQuAD ({'data': [{'paragraphs': [{'context', 'qas'}]}]})" if dataset == "squad" else \
            "HotpotQA ([{'question', 'answer', 'context': [[title, sentences]]}])"
        raise ValueError(f"{path} is not in the official {expected} format: {error!r}") from None
    if not questions:
        raise ValueError(f"{path} holds no answerable questions")
    digest = hashlib.sha256(raw).hexdigest()
    return QAData(questions, documents, {f"ruler/{dataset}/{path.name}": digest}, digest in FIXTURE_SHA256)


@dataclass
class QA(Generator):
    """RULER qa: one question over its gold documents and `size - gold` distractor documents."""

    dataset: str = "squad"
    data: QAData | None = field(default=None, repr=False)
    kind: str = "qa"

    def question(self, index: int) -> dict[str, Any]:
        assert self.data is not None
        return self.data.questions[index]

    def plan(self, rng: random.Random, length: int, index: int = 0) -> dict[str, Any]:
        q = self.question(index)
        return {"seed": rng.getrandbits(63), "index": index, "query": q["query"], "answers": list(q["answers"])}

    def min_size(self, plan: dict[str, Any]) -> int:
        return len(self.question(plan["index"])["gold"])

    def render(self, plan: dict[str, Any], size: int, example: str = "") -> tuple[str, str]:
        assert self.data is not None
        q = self.question(plan["index"])
        rng = random.Random(sub_seed(plan["seed"], size))
        gold, more = list(q["gold"]), list(q["more"])
        if size >= len(self.data.documents):  # every document, repeated as often as needed
            chosen = [i % len(self.data.documents) for i in range(size)]
        elif size - len(gold) > len(more):
            taken = set(gold) | set(more)
            others = [i for i in range(len(self.data.documents)) if i not in taken]
            chosen = gold + more + rng.sample(others, size - len(gold) - len(more))
        else:
            chosen = gold + rng.sample(more, max(0, size - len(gold)))
        rng.shuffle(chosen)
        context = "\n\n".join(DOCUMENT.format(i=i + 1, document=self.data.documents[d]) for i, d in enumerate(chosen))
        t = TEMPLATES["qa"]
        return t["template"].format(context=context, query=plan["query"]), t["answer_prefix"]
