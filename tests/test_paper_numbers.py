"""The transcribed paper numbers (results/paper/*.csv) against what the paper itself derives from them.

Each check recomputes a number the paper prints from other numbers it prints (a row's average, the
sample-weighted compression average, Table 3's mean and std, the Table 15/16 KeyDiff rows that "match
Table 11", Table 14 cells that repeat Table 1, Table 19's normalisation, the granularity of Table 17/18),
so a mistyped or shifted cell fails here. Cells the extracted text garbles are empty with a "garbled:"
note and must be listed in results/paper/README.md.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parent.parent
PAPER = ROOT / "results" / "paper"
TEXT = ROOT.parent / "shared" / "reference" / "keydiff-paper.txt"
sys.path.insert(0, str(ROOT / "scripts"))

from collect_results import LONGBENCH  # noqa: E402

TABLES = [1, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19]
ENGLISH = [d for d in LONGBENCH if d not in ("multifieldqa_zh", "dureader", "vcsum", "lsht", "passage_retrieval_zh")]
ROUNDING = 0.0101  # two printed 2-decimal roundings


def table(n: int) -> pd.DataFrame:
    return pd.read_csv(PAPER / f"table{n}.csv", dtype={"budget": str, "block_size": str, "column": str, "row": str},
                       keep_default_na=False, na_values={"value": [""]})


def rows(n: int):
    """LongBench tables: (model, policy, budget) -> {column: value}, complete rows only."""
    frame = table(n)
    frame = frame[frame["value"].notna()]
    return {key: dict(zip(g["column"], g["value"])) for key, g in frame.groupby(["model", "policy", "budget"])}


def test_every_table_is_there_with_its_caption():
    captions = pd.read_csv(PAPER / "captions.csv")
    assert list(captions["table"]) == TABLES
    for n in TABLES:
        frame = table(n)
        assert (frame["table"] == n).all() and len(frame) >= 1
        assert list(frame.columns) == ["table", "model", "policy", "budget", "block_size", "row", "column", "metric",
                                       "value", "note"]
    assert captions.set_index("table").loc[18, "caption"].startswith("Recall difference (KEYDIFF-Full)")


def test_garbled_cells_are_empty_and_listed_in_the_readme():
    readme = (PAPER / "README.md").read_text()
    for n in TABLES:
        frame = table(n)
        garbled = frame[frame["note"].str.startswith("garbled")]
        assert garbled["value"].isna().all() and frame.loc[frame["value"].isna(), "note"].str.startswith("garbled").all()
        for _, cell in garbled.drop_duplicates(["model", "policy", "budget"]).iterrows():
            name = f"Table {n}" + (f" / {cell['model']} / {cell['policy']} / {cell['budget'] or '--'}" if cell["model"] else "")
            assert name in readme, f"{name} garbled but not listed in results/paper/README.md"


@pytest.mark.parametrize("n, columns", [(1, ENGLISH), (10, list(LONGBENCH)[1:]), (13, list(LONGBENCH)),
                                        (14, list(LONGBENCH))])
def test_longbench_row_averages(n, columns):
    found = rows(n)
    assert found, f"table {n} has no complete row"
    for key, cells in found.items():
        assert set(cells) == set(columns) | {"avg"}, key
        assert np.mean([cells[c] for c in columns]) == pytest.approx(cells["avg"], abs=ROUNDING), key


def test_table1_shape_and_known_cells():
    t1 = rows(1)
    assert len(t1) == 2 * (1 + 5 * 4) - 1  # one row garbled (see README)
    assert t1[("llama-3.1-8b-instruct", "keydiff", "2k")]["passage_retrieval_en"] == 96.00
    assert t1[("llama-3.2-3b-instruct", "snapkv", "8k")]["avg"] == 44.96
    dagger = table(1)[table(1)["note"].str.startswith("dagger")]
    assert list(dagger["column"]) == ["narrativeqa"] and list(dagger["policy"]) == ["full"]


def test_table14_repeats_table1_on_english_columns():
    t1, t14 = rows(1), rows(14)
    shared = [k for k in t14 if k in t1]
    assert len(shared) >= 5
    for key in shared:
        assert all(t14[key][c] == t1[key][c] for c in ENGLISH), key


def test_table15_16_keydiff_rows_match_each_other_and_table14():
    t15, t16 = table(15), table(16)
    kd15 = t15[t15.policy == "keydiff"].set_index("budget")["value"]
    kd16 = t16[t16.policy == "keydiff"].set_index("budget")["value"]
    assert kd15.to_dict() == kd16.to_dict() == {"2k": 35.09, "4k": 40.28, "6k": 41.88, "8k": 42.40}
    t14 = rows(14)
    for budget, value in kd15.items():
        if ("llama-3.2-3b-instruct", "keydiff", budget) in t14:
            assert t14[("llama-3.2-3b-instruct", "keydiff", budget)]["avg"] == value


def test_table3_mean_and_std():
    t3 = table(3).set_index("column")["value"]
    layers = t3[[f"layer{i}" for i in range(1, 25)]]
    assert round(layers.mean(), 2) == t3["mean"] == 0.94
    assert round(layers.std(ddof=0), 2) == t3["std"] or round(layers.std(ddof=1), 2) == t3["std"]


def test_table8_bins_sum_to_totals():
    t8 = table(8).pivot(index="column", columns="metric", values="value")
    assert len(t8) == 21
    assert (t8[["<=2K", "2K-4K", "4K-6K", "6K-8K", ">=8K"]].sum(axis=1) == t8["total"]).all()


def test_table9_ratios_average_and_text():
    t9 = table(9).pivot(index="column", columns="budget", values="value")
    weights = table(8).pivot(index="column", columns="metric", values="value")["total"]
    data = t9.drop("average")
    assert (data.stack().dropna() <= 1).all() and set(data.index) == set(weights.index)
    for budget in data.columns:  # "Average Compression Ratio = 1/I sum_i N / L_i": over samples, not datasets
        column = data[budget]
        if column.notna().all():
            weighted = (column * weights[column.index]).sum() / weights[column.index].sum()
            assert weighted == pytest.approx(t9.loc["average", budget], abs=ROUNDING), budget
    # §4.1 / §F.3: "2K ... 0.31", "8K ... 0.77", "6k and 8k ... compressed by 33% and 23%"
    assert t9.loc["average", "2k"] == 0.31 and t9.loc["average", "8k"] == 0.77
    assert round(1 - t9.loc["average", "6k"], 2) == 0.33 and round(1 - t9.loc["average", "8k"], 2) == 0.23


def test_math_tables():
    for n in (4, 6):
        t = table(n)
        assert set(t["column"]) == {"4K", "8K", "32K"} and len(t) == 17 * 3
        assert ((t.metric != "avg_gen_length") | (t.value > 1000)).all() and t[t.metric != "avg_gen_length"].value.le(1).all()
        assert (t[t.policy == "full"]["budget"] == "").all()
    for n in (5, 7):
        t = table(n)
        for _, cell in t[t.policy != "full"].iterrows():  # the subset is the samples over this very budget
            assert cell["row"].startswith(f"num_tokens>{cell['budget'].upper()} ")
        counts = t.assign(n=t["row"].str.extract(r"\((\d+)/500\)")[0].astype(int),
                          k=t["row"].str.extract(r">(\d+)K")[0].astype(int))
        for _, g in counts.groupby("column"):
            ordered = g.drop_duplicates("k").sort_values("k")
            assert ordered["n"].is_monotonic_decreasing


def test_small_grids():
    t17 = table(17)
    assert np.allclose(t17.value * 5, np.round(t17.value * 5))  # five phonebooks per size
    t18 = table(18)
    assert len(t18) == 100 and t18.value.abs().le(1).all()
    assert np.allclose(t18.value * 50, np.round(t18.value * 50))  # differences of recalls in steps of 1/50
    t19 = table(19).set_index(["policy", "column"])["value"]
    assert t19[("keydiff", "512")] == 1.00 and len(t19) == 20


def test_csvs_are_what_the_transcriber_makes_from_the_text(tmp_path):
    if not TEXT.exists():
        pytest.skip(f"reference text not present at {TEXT}")
    import transcribe_paper

    tables, captions = transcribe_paper.build(TEXT)
    transcribe_paper.write(tables, captions, tmp_path)
    (tmp_path / "README.md").write_text(transcribe_paper.readme(tables))
    for path in sorted(PAPER.glob("*.csv")) + [PAPER / "README.md"]:
        assert (tmp_path / path.name).read_text() == path.read_text(), path.name
