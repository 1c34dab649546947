"""Table 3: per-layer Spearman rho between negative key cosine similarity and the attention each key receives.

    python -m keydiff.analysis.table3 [model=...] [samples=4] [length=2048] [data.source=longbench]

Writes <tables_dir>/table3_spearman.{md,csv,json}.
Design: docs/design/reports.md#figures-reportfigures-analysisfigures
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import pandas as pd
import torch

from keydiff.analysis.common import config_from_command_line, inputs_record, prompts
from keydiff.analysis.statistics import keydiff_attention_spearman
from keydiff.bench.common import CHECKOUT, provenance, write_json
from keydiff.capture import capture_prompt
from keydiff.models import load_model

# Table 3 of the paper: its model and setting, and where its numbers are kept (results/paper/table3.csv).
PAPER_MODEL = "llama-3.2-3b-instruct"
PAPER_SETTING = ("Llama-3.2-3B-Instruct, LongBench MuSiQue; 24 columns labelled layer 1..24, although the model has "
                 "28 layers and 24 query heads; the attention compared is not stated")
PAPER_CSV = CHECKOUT / "results" / "paper" / "table3.csv"


def paper_table3(path: Path = PAPER_CSV) -> tuple[list[float], tuple[float, float]]:
    """The paper's per-column rho (columns "layer1".."layer24", in order) and its (mean, std) cell."""
    rows = [r for r in csv.DictReader(path.open(encoding="utf-8")) if r["metric"] == "spearman_rho"]
    layers = sorted((int(r["column"][len("layer"):]), float(r["value"])) for r in rows if r["column_kind"] == "layer")
    cells = {r["column"]: float(r["value"]) for r in rows if r["column_kind"] != "layer"}
    return [value for _, value in layers], (cells["avg"], cells["std"])


def measure(cfg, model, prompt_list) -> pd.DataFrame:
    """One row per (sample, layer, query head) with rho."""
    rows = []
    for sample_id, ids in prompt_list:
        for layer, capture in enumerate(capture_prompt(model, ids, window=cfg.window)):
            target = {"mean_received": capture.received_mean, "column_sum": capture.received_sum,
                      "last_row": capture.last_row}[cfg.attention]
            rho = keydiff_attention_spearman(capture.keys, target, cfg.anchor)
            rows += [{"sample": sample_id, "layer": layer + 1, "head": head, "rho": float(value)}
                     for head, value in enumerate(rho.tolist())]
        print(f"  {sample_id}: {ids.numel()} tokens", flush=True)
    return pd.DataFrame(rows)


def summarize(rhos: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame, tuple[float, float]]:
    """Per layer and per head: mean, std (ddof 0) and count over the rest; mean +- std of the layer means."""
    def stats(by: str) -> pd.DataFrame:
        grouped = rhos.groupby(by)["rho"]
        return pd.DataFrame({"mean": grouped.mean(), "std": grouped.std(ddof=0), "n": grouped.count()})

    per_layer = stats("layer")
    return per_layer, stats("head"), (float(per_layer["mean"].mean()), float(per_layer["mean"].std(ddof=0)))


def markdown(cfg, per_layer, per_head, overall, data) -> str:
    """Ours beside the paper, layer by layer, with the model and setting of each and a caveat line."""
    source = data.get("dataset", data.get("description", data["source"]))
    paper, (paper_mean, paper_std) = paper_table3()
    ours = (f"{cfg.model.name}, {len(data['samples'])} prompt(s) of up to {cfg.length} tokens from {data['source']} "
            f"({source}), anchor `{cfg.anchor}`, attention `{cfg.attention}`")
    same = cfg.model.name == PAPER_MODEL
    caveat = ("Same model as the paper; the prompts, their number and the attention compared may still differ."
              if same else
              f"Caveat: different models and settings. Ours: {ours}. The paper's: {PAPER_SETTING}. The columns are "
              "side by side for reference, not a reproduction; run `make analysis ANALYSIS_ARGS=\"model="
              f"{PAPER_MODEL}\"` for the paper's model.")
    lines = ["# Table 3: Spearman rho(-cos(k, anchor), attention received), ours beside the paper's", "",
             f"Ours: {ours}; mean +- std over query heads and prompts.",
             f"Paper: {PAPER_SETTING}.", "", caveat, "",
             f"| layer | rho, ours ({cfg.model.name}) | n | rho, paper ({PAPER_MODEL}) |", "|---:|---:|---:|---:|"]
    layers = sorted(set(per_layer.index) | set(range(1, len(paper) + 1)))
    for layer in layers:
        row = per_layer.loc[layer] if layer in per_layer.index else None
        mine = f"{row['mean']:.4f} +- {row['std']:.4f} | {int(row['n'])}" if row is not None else "-- | --"
        theirs = f"{paper[layer - 1]:.4f}" if layer <= len(paper) else "--"
        lines.append(f"| {layer} | {mine} | {theirs} |")
    lines += [f"| mean of layers | {overall[0]:.4f} +- {overall[1]:.4f} | {len(per_layer)} | "
              f"{paper_mean:.2f} +- {paper_std:.2f} |", "",
              "Per query head (mean over layers and prompts):", "", "| head | rho | n |", "|---:|---:|---:|"]
    row_line = lambda key, row: f"| {key} | {row['mean']:.4f} +- {row['std']:.4f} | {int(row['n'])} |"  # noqa: E731
    lines += [row_line(head, row) for head, row in per_head.iterrows()]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> None:
    started = provenance(__spec__.name, argv)
    cfg, model_cfg = config_from_command_line(argv, eviction=False)
    print(f"loading {cfg.model.name} to measure Table 3 on {cfg.samples} prompt(s) of {cfg.length} tokens "
          "(default model on one CPU core: about 1 min)", flush=True)
    model, tokenizer = load_model(model_cfg)
    prompt_list, data = prompts(cfg, tokenizer, default_dataset="musique")
    data["samples"] = [sid for sid, _ in prompt_list]
    print(f"Table 3 on {cfg.model.name}: {len(prompt_list)} prompt(s)", flush=True)
    rhos = measure(cfg, model, prompt_list)
    per_layer, per_head, overall = summarize(rhos)
    out = CHECKOUT / cfg.tables_dir
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "table3_spearman.md", out / "table3_spearman.csv", out / "table3_spearman.json"]
    paths[0].write_text(markdown(cfg, per_layer, per_head, overall, data), encoding="utf-8")
    rhos.to_csv(paths[1], index=False)
    record = inputs_record(cfg, model_cfg, model, data, prompt_list, paths)
    record["results"] = {"per_layer": per_layer.reset_index().to_dict("records"),
                         "per_head": per_head.reset_index().to_dict("records"),
                         "mean_of_layers": overall[0], "std_of_layers": overall[1],
                         "paper": {"per_column": paper_table3()[0], "mean": paper_table3()[1][0],
                                   "std": paper_table3()[1][1], "model": PAPER_MODEL, "setting": PAPER_SETTING}}
    write_json(paths[2], record, started)
    print(paths[0].read_text(encoding="utf-8").split("\n\nPer query head")[0])
    print("wrote " + ", ".join(str(p) for p in paths))


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main(sys.argv[1:])
