"""Write a tiny made-up RULER QA fixture in the official SQuAD v2.0 and HotpotQA (distractor) formats.

Every text is invented for the project. `squad.json` has 3 articles of 3 paragraphs, answerable questions
whose answers are spans of their paragraph (`answer_start` set) and one unanswerable question
(`is_impossible`), which RULER drops. `hotpotqa.json` has 3 questions with 4 (title, sentences)
paragraphs each; every answer appears in one of its paragraphs. Output is deterministic.

The fixture is for tests and smoke runs only: keydiff/tasks/ruler_qa.py recognises it by its sha256
(``FIXTURE_SHA256``; a test checks they agree, so update it when this builder changes) and marks runs on it
as not comparable to published RULER numbers.

    python -m keydiff.tasks.fixture_builders.ruler            # -> tasks/fixtures/ruler/{squad,hotpotqa}.json
    python -m keydiff.tasks.fixture_builders.ruler --out /tmp/r
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from keydiff.tasks.fixture_builders import FIXTURES

ARTICLES = {
    "Varrow_Point": [
        ("The lighthouse at Varrow Point was built in 1871 from granite quarried on the island of Tessel. "
         "Its first keeper, Amos Reddle, kept a ledger of every ship that passed the reef.",
         [("In what year was the lighthouse at Varrow Point built?", "1871"),
          ("Who was the first keeper of the Varrow Point lighthouse?", "Amos Reddle")]),
        ("The lamp of the lighthouse burned whale oil until 1903, when it was replaced by a kerosene burner. "
         "The light could be seen from eighteen nautical miles on a clear night.",
         [("What fuel did the Varrow Point lamp burn before 1903?", "whale oil")]),
        ("In 1958 the station was automated and the keeper's cottage became a small museum about the reef. "
         "The museum displays the original ledger and a brass foghorn.",
         [("What did the keeper's cottage become after automation?", "a small museum"),
          ("Which instrument made of brass is shown in the museum at Varrow Point?", "the submarine bell")]),
    ],
    "Orlen_Valley_Railway": [
        ("The Orlen Valley Railway opened in 1894 to carry slate from the upper quarries to the harbour at Saltmere. "
         "Its narrow gauge of two feet allowed the line to follow the river closely.",
         [("What did the Orlen Valley Railway originally carry?", "slate"),
          ("What was the gauge of the Orlen Valley Railway?", "two feet")]),
        ("Passenger services began in 1899 with two carriages pulled by the locomotive Wren. "
         "Tourists soon outnumbered quarry workers on summer weekends.",
         [("Which locomotive pulled the first passenger services?", "Wren")]),
        ("The line closed in 1947 after the quarries shut, and volunteers reopened the lower section in 1972 as a heritage railway.",
         [("When did volunteers reopen the lower section of the line?", "1972")]),
    ],
    "Glass_Harp_Society": [
        ("The Glass Harp Society was founded in Lindau by the instrument maker Petra Voss in 1923. "
         "Members tuned wine glasses with water and played them with wet fingertips.",
         [("Who founded the Glass Harp Society?", "Petra Voss"),
          ("In which town was the Glass Harp Society founded?", "Lindau")]),
        ("The society's orchestra toured eleven countries between the wars and recorded four albums for the Aurel label.",
         [("How many countries did the society's orchestra tour?", "eleven")]),
        ("Today the society runs a summer school where students learn to tune glasses by ear.",
         [("What does the society run today?", "a summer school")]),
    ],
}
# The one unanswerable question (SQuAD v2.0 "is_impossible"); RULER drops such questions.
IMPOSSIBLE = ("Varrow_Point", 2, "Which instrument made of brass is shown in the museum at Varrow Point?")

HOTPOT = [
    {
        "question": "Which river flows past the town where the composer of the Lantern Suite was born?",
        "answer": "the Mirren",
        "context": [
            ["Lantern Suite", ["The Lantern Suite is a set of five pieces for string quartet. ",
                               "It was written by Ilse Marrow in 1931."]],
            ["Ilse Marrow", ["Ilse Marrow was a composer born in the town of Kettleby. ",
                             "She taught harmony at the Brenner Conservatory."]],
            ["Kettleby", ["Kettleby is a market town on the Mirren. ",
                          "Its bridge dates from the fourteenth century."]],
            ["Brenner Conservatory", ["The Brenner Conservatory admits forty students a year."]],
        ],
    },
    {
        "question": "What was the name of the ship commanded by the founder of Port Alder?",
        "answer": "Cormorant",
        "context": [
            ["Port Alder", ["Port Alder is a fishing harbour founded by Captain Jory Pell in 1788."]],
            ["Jory Pell", ["Jory Pell commanded the brig Cormorant for twelve years. ",
                           "He retired to the harbour he had founded."]],
            ["Cormorant (brig)", ["The Cormorant was a two-masted brig of ninety tons."]],
            ["Alder Light", ["Alder Light marks the entrance of the harbour."]],
        ],
    },
    {
        "question": "In which year did the author of The Salt Orchard win the Penrose Prize?",
        "answer": "1964",
        "context": [
            ["The Salt Orchard", ["The Salt Orchard is a novel by Dana Whitcombe about a family of apple growers."]],
            ["Dana Whitcombe", ["Dana Whitcombe won the Penrose Prize in 1964 for her second novel. ",
                                "She lived on the coast of Hallam."]],
            ["Penrose Prize", ["The Penrose Prize is awarded each year to a work of fiction."]],
            ["Hallam", ["Hallam is a rocky stretch of coast with many orchards."]],
        ],
    },
]


def squad() -> dict:
    data = []
    for title, paragraphs in ARTICLES.items():
        out_paragraphs = []
        for p_index, (context, qas) in enumerate(paragraphs):
            out_qas = []
            for q_index, (question, answer) in enumerate(qas):
                impossible = (title, p_index, question) == IMPOSSIBLE
                qid = f"{title}-{p_index}-{q_index}"
                if impossible:
                    out_qas.append({"question": question, "id": qid, "answers": [], "is_impossible": True,
                                    "plausible_answers": [{"text": "a brass foghorn", "answer_start": context.find("a brass foghorn")}]})
                    continue
                start = context.find(answer)
                if start < 0:
                    raise ValueError(f"answer {answer!r} is not a span of its paragraph")
                out_qas.append({"question": question, "id": qid, "answers": [{"text": answer, "answer_start": start}],
                                "is_impossible": False})
            out_paragraphs.append({"qas": out_qas, "context": context})
        data.append({"title": title, "paragraphs": out_paragraphs})
    return {"version": "v2.0", "data": data}


def hotpotqa() -> list:
    records = []
    for i, record in enumerate(HOTPOT):
        text = " ".join("".join(sentences) for _, sentences in record["context"])
        if record["answer"] not in text:
            raise ValueError(f"answer {record['answer']!r} does not appear in its paragraphs")
        records.append({"_id": f"fixture{i}", "question": record["question"], "answer": record["answer"],
                        "type": "bridge", "level": "medium", "supporting_facts": [], "context": record["context"]})
    return records


def write_fixture(out: Path) -> list[Path]:
    """Write `out/squad.json` and `out/hotpotqa.json` (the folder is created); returns their paths."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "squad.json", out / "hotpotqa.json"]
    paths[0].write_text(json.dumps(squad(), indent=1) + "\n", encoding="utf-8")
    paths[1].write_text(json.dumps(hotpotqa(), indent=1) + "\n", encoding="utf-8")
    return paths


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=FIXTURES / "ruler",
                        help="output folder (default: this checkout's tasks/fixtures/ruler)")
    paths = write_fixture(parser.parse_args(argv).out)
    print("wrote " + ", ".join(str(p) for p in paths))


if __name__ == "__main__":
    main()
