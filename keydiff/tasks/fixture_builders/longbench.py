"""Write a tiny made-up LongBench fixture in the official layout, for offline tests.

Layout: `<out>/data/<name>.jsonl` for the 21 v1 datasets and the 13 `<name>_e` LongBench-E files, 2-3
records each, with the official fields (input, context, answers, length, dataset, language,
all_classes, _id). Every text is invented. The second record of each file has a long context so that
middle truncation triggers at a small max_length. `length` is the official definition (whitespace
words, characters for Chinese) for v1 files; the `_e` files instead carry the made-up lengths
3999 / 4000 / 8000 so that their records fall into the three LongBench-E buckets at the boundaries.

Output is deterministic: the same command writes byte-identical jsonl files.

    python -m keydiff.tasks.fixture_builders.longbench                      # -> tasks/fixtures/longbench/data/*.jsonl
    python -m keydiff.tasks.fixture_builders.longbench --out /tmp/lb --zip   # also writes /tmp/lb/data.zip
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import zipfile
import zlib
from pathlib import Path
from typing import Any, Callable

from keydiff.tasks.fixture_builders import FIXTURES
from keydiff.tasks.longbench import ALL_21, LONGBENCH_E_13

E_LENGTHS = (3999, 4000, 8000)

EN_SENTENCES = (
    "The lighthouse keeper of Varrow Point kept a ledger of every ship that passed the reef.",
    "In the spring the river flooded the lower fields and the mill stopped for nine days.",
    "Professor Ilse Marund argued that the tidal clocks were older than the harbour itself.",
    "The committee met on a Tuesday and postponed the vote on the new bridge once again.",
    "A small robot named Pell learned to sort the seeds by colour before the first frost.",
    "Nobody in the village remembered who had painted the blue door on the chapel.",
    "The budget for the western rail line rose by twelve percent over three years.",
    "Marta kept the letters in a tin box under the floorboards of the attic.",
    "The survey counted four hundred and six nesting terns on the northern dunes.",
    "During the storm the ferry waited at Kessel Quay until the wind turned south.",
)
ZH_SENTENCES = (
    "青石镇的图书馆每周三晚上开放到九点。",
    "会议决定把新仓库建在河的东岸。",
    "李老师说这座桥是在一九六二年修好的。",
    "春天的时候山上的茶园需要很多工人。",
    "小王负责记录每天进港的渔船数量。",
    "这家工厂去年的产量增加了百分之十五。",
    "村里的人都说那口古井从来没有干过。",
    "研究小组在湖边发现了三种新的水鸟。",
)
CODE_LINES = (
    "def area(self):",
    "    return self.width * self.height",
    "class Box:",
    "    def __init__(self, width, height):",
    "        self.width = width",
    "        self.height = height",
    "import math",
    "def distance(a, b):",
    "    return math.hypot(a.x - b.x, a.y - b.y)",
    "items = [Box(2, 3), Box(4, 5)]",
    "total = sum(item.area() for item in items)",
)
TREC_CLASSES = [
    "Abbreviation", "Animal", "City", "Country", "Date", "Definition of something", "Description of something",
    "Individual", "Other location", "Other number", "Other entity", "Reason", "Manner of an action", "Price",
]  # fmt: skip
LSHT_CLASSES = ["体育", "财经", "科技", "教育", "娱乐", "农业", "军事", "汽车"]


def _en(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(EN_SENTENCES) for _ in range(n))


def _zh(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(ZH_SENTENCES) for _ in range(n))


def _passages(rng: random.Random, n: int, sentences: int) -> str:
    return "\n\n".join(f"Passage {i + 1}:\n{_en(rng, sentences)}" for i in range(n))


def _qa_en(rng: random.Random, i: int) -> dict[str, Any]:
    questions = ("Who kept a ledger of ships?", "How long did the mill stop?", "Where did the ferry wait?")
    answers = (["the lighthouse keeper", "keeper"], ["nine days"], ["Kessel Quay"])
    return {"input": questions[i], "context": _en(rng, 3 if i != 1 else 28), "answers": answers[i]}


def _multi_hop(rng: random.Random, i: int) -> dict[str, Any]:
    record = _qa_en(rng, i)
    record["context"] = _passages(rng, 3 if i != 1 else 8, 1 if i != 1 else 4)
    return record


def _summary_en(rng: random.Random, i: int) -> dict[str, Any]:
    summaries = (
        "The committee postponed the bridge vote. The rail budget rose.",
        "A storm delayed the ferry. The survey counted terns on the dunes.",
        "The mill stopped after the flood.",
    )
    query = "" if i else "What did the committee decide?"
    return {"input": query, "context": _en(rng, 4 if i != 1 else 30), "answers": [summaries[i]]}


def _qa_zh(rng: random.Random, i: int) -> dict[str, Any]:
    questions = ("图书馆周三开放到几点？", "新仓库建在哪里？", "桥是哪一年修好的？")
    answers = (["九点"], ["河的东岸"], ["一九六二年"])
    return {"input": questions[i], "context": _zh(rng, 4 if i != 1 else 40), "answers": answers[i]}


def _summary_zh(rng: random.Random, i: int) -> dict[str, Any]:
    summaries = ("会议决定在东岸建仓库，并讨论了茶园的用工问题。", "研究小组介绍了湖边的新水鸟。", "工厂产量增加。")
    return {"input": "", "context": _zh(rng, 5 if i != 1 else 40), "answers": [summaries[i]]}


def _trec(rng: random.Random, i: int) -> dict[str, Any]:
    shots = [("What year did the bridge open ?", "Date"), ("What does NATO stand for ?", "Abbreviation"),
             ("Which city has the oldest harbour ?", "City"), ("Why do terns nest on dunes ?", "Reason")]  # fmt: skip
    n = 4 if i != 1 else 40
    context = "\n".join(f"Question: {q}\nType: {t}" for q, t in (rng.choice(shots) for _ in range(n)))
    inputs = ("What is the capital of Varrow ?", "How much does a ferry ticket cost ?", "Who painted the blue door ?")
    answers = (["City"], ["Price"], ["Individual"])
    return {"input": f"Question: {inputs[i]}\nType:", "context": context, "answers": answers[i]}


def _triviaqa(rng: random.Random, i: int) -> dict[str, Any]:
    n = 2 if i != 1 else 10
    shot = "Passage: {}\nQuestion: Where is Varrow Point?\nAnswer: on the reef coast"
    context = "\n\n".join(shot.format(_en(rng, 2)) for _ in range(n))
    inputs = ("Passage: The ferry waited at Kessel Quay.\nQuestion: Where did the ferry wait?\nAnswer:",
              "Passage: Marta kept the letters in a tin box.\nQuestion: What held the letters?\nAnswer:",
              "Passage: Pell sorted seeds.\nQuestion: What was the robot called?\nAnswer:")  # fmt: skip
    answers = (["Kessel Quay", "Kessel"], ["a tin box", "tin box", "box"], ["Pell"])
    return {"input": inputs[i], "context": context, "answers": answers[i]}


def _samsum(rng: random.Random, i: int) -> dict[str, Any]:
    n = 2 if i != 1 else 12
    context = "\n\n".join(
        "Dialogue: Anna: Is the ferry running?\nBen: Not until the wind turns.\nSummary: The ferry waits for the wind."
        for _ in range(n)
    )
    inputs = ("Dialogue: Tom: I left the letters in the attic.\nKim: I will fetch them.\nSummary:",
              "Dialogue: Eva: The mill stopped again.\nJon: The river flooded.\nSummary:",
              "Dialogue: Sam: Vote is postponed.\nLiv: Again?\nSummary:")  # fmt: skip
    answers = (["Kim will fetch the letters Tom left in the attic."], ["The mill stopped because the river flooded."],
               ["The vote is postponed again."])  # fmt: skip
    return {"input": inputs[i], "context": context, "answers": answers[i]}


def _lsht(rng: random.Random, i: int) -> dict[str, Any]:
    n = 3 if i != 1 else 20
    context = "\n".join(f"新闻：{rng.choice(ZH_SENTENCES)}\n类别：{rng.choice(LSHT_CLASSES)}" for _ in range(n))
    inputs = ("新闻：研究小组在湖边发现了三种新的水鸟。", "新闻：这家工厂去年的产量增加了百分之十五。", "新闻：春天的时候山上的茶园需要很多工人。")
    answers = (["科技"], ["财经"], ["农业"])
    return {"input": inputs[i], "context": context, "answers": answers[i]}


def _passage_count(rng: random.Random, i: int) -> dict[str, Any]:
    unique = [_en(rng, 1 if i != 1 else 3) for _ in range(3 + i)]
    paragraphs = unique + unique[:2]
    rng.shuffle(paragraphs)
    context = "\n\n".join(f"Paragraph {k + 1}: {text}" for k, text in enumerate(paragraphs))
    return {"input": "", "context": context, "answers": [str(len(set(unique)))]}


def _retrieval_en(rng: random.Random, i: int) -> dict[str, Any]:
    paragraphs = [_en(rng, 1 if i != 1 else 4) for _ in range(4)]
    target = (2, 4, 1)[i]
    context = "\n\n".join(f"Paragraph {k + 1}: {text}" for k, text in enumerate(paragraphs))
    return {"input": paragraphs[target - 1].split(".")[0] + ".", "context": context, "answers": [f"Paragraph {target}"]}


def _retrieval_zh(rng: random.Random, i: int) -> dict[str, Any]:
    paragraphs = [_zh(rng, 1 if i != 1 else 6) for _ in range(4)]
    target = (3, 1, 2)[i]
    context = "\n\n".join(f"段落{k + 1}：{text}" for k, text in enumerate(paragraphs))
    return {"input": paragraphs[target - 1][:12], "context": context, "answers": [f"段落{target}"]}


def _lcc(rng: random.Random, i: int) -> dict[str, Any]:
    n = 6 if i != 1 else 60
    context = "\n".join(rng.choice(CODE_LINES) for _ in range(n)) + "\n"
    answers = (["    return self.width * self.height"], ["total = sum(item.area() for item in items)"], ["import math"])
    return {"input": "", "context": context, "answers": answers[i]}


def _repobench(rng: random.Random, i: int) -> dict[str, Any]:
    n = 5 if i != 1 else 50
    context = "# Path: geometry/shapes.py\n" + "\n".join(rng.choice(CODE_LINES) for _ in range(n)) + "\n"
    inputs = ("# Path: geometry/main.py\nfrom geometry.shapes import Box\nbox = Box(2, 3)\n",
              "# Path: geometry/report.py\nimport math\n", "# Path: geometry/util.py\n")  # fmt: skip
    answers = (["print(box.area())"], ["def report(items):"], ["def distance(a, b):"])
    return {"input": inputs[i], "context": context, "answers": answers[i]}


GENERATORS: dict[str, Callable[[random.Random, int], dict[str, Any]]] = {
    "narrativeqa": _qa_en, "qasper": _qa_en, "multifieldqa_en": _qa_en, "multifieldqa_zh": _qa_zh,
    "hotpotqa": _multi_hop, "2wikimqa": _multi_hop, "musique": _multi_hop, "dureader": _qa_zh,
    "gov_report": _summary_en, "qmsum": _summary_en, "multi_news": _summary_en, "vcsum": _summary_zh,
    "trec": _trec, "triviaqa": _triviaqa, "samsum": _samsum, "lsht": _lsht,
    "passage_count": _passage_count, "passage_retrieval_en": _retrieval_en,
    "passage_retrieval_zh": _retrieval_zh, "lcc": _lcc, "repobench-p": _repobench,
}  # fmt: skip
LANGUAGES = {"multifieldqa_zh": "zh", "dureader": "zh", "vcsum": "zh", "lsht": "zh", "passage_retrieval_zh": "zh",
             "lcc": "python", "repobench-p": "python"}  # fmt: skip


def official_length(record: dict[str, Any], language: str) -> int:
    """LongBench's `length`: characters (without whitespace) for Chinese, whitespace words otherwise."""
    text = record["input"] + record["context"] + "".join(record["answers"])
    return len("".join(text.split())) if language == "zh" else len(text.split())


def make_records(stem: str) -> list[dict[str, Any]]:
    """The records of file `<stem>.jsonl` (stem is a v1 name or `<name>_e`)."""
    is_e = stem.endswith("_e")
    dataset = stem[: -len("_e")] if is_e else stem
    rng = random.Random(zlib.crc32(stem.encode()))
    language = LANGUAGES.get(dataset, "en")
    records = []
    for i in range(3):
        record = GENERATORS[dataset](rng, i)
        record["length"] = E_LENGTHS[i] if is_e else official_length(record, language)
        record["dataset"] = dataset
        record["language"] = language
        record["all_classes"] = TREC_CLASSES if dataset == "trec" else LSHT_CLASSES if dataset == "lsht" else None
        record["_id"] = hashlib.sha256(f"{stem}/{i}".encode()).hexdigest()[:48]
        records.append(record)
    return records


def write_fixture(out: Path) -> list[Path]:
    """Write every jsonl file under `out/data/`; returns their paths."""
    data = out / "data"
    data.mkdir(parents=True, exist_ok=True)
    paths = []
    for stem in [*ALL_21, *(f"{name}_e" for name in LONGBENCH_E_13)]:
        path = data / f"{stem}.jsonl"
        lines = [json.dumps(record, ensure_ascii=False) for record in make_records(stem)]
        path.write_text("\n".join(lines) + "\n", encoding="utf-8")
        paths.append(path)
    return paths


def write_zip(out: Path, zip_path: Path) -> Path:
    """Pack `out/data/*.jsonl` into `zip_path` as `data/<name>.jsonl`, like the official data.zip."""
    with zipfile.ZipFile(zip_path, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        for path in sorted((out / "data").glob("*.jsonl")):
            info = zipfile.ZipInfo(f"data/{path.name}", date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_DEFLATED
            archive.writestr(info, path.read_bytes())
    return zip_path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=FIXTURES / "longbench",
                        help="output folder (default: this checkout's tasks/fixtures/longbench)")
    parser.add_argument("--zip", action="store_true", help="also write <out>/data.zip")
    args = parser.parse_args(argv)
    paths = write_fixture(args.out)
    print(f"wrote {len(paths)} files under {args.out / 'data'}")
    if args.zip:
        print(f"wrote {write_zip(args.out, args.out / 'data.zip')}")


if __name__ == "__main__":
    main()
