"""Side by side with NVIDIA's kvpress on identical random weights: kept positions (parity) and speed/memory.

    make bench-peers                                              # builds .venv-kvpress once, then both parts
    python -m keydiff.bench peers parity --length 512 --budget 128
    python -m keydiff.bench peers perf --lengths 4096,16384,32768 --rounds 3 --threads 2
    python -m keydiff.bench peers perf --cases kvpress_keydiff,keydiff_blockwise     # skip the slow ones
    python -m keydiff.bench peers all --device cuda --shape llama-3.2-3b     # on a GPU, unchanged
    python -m keydiff.bench peers tables results/bench/peers_cpu_4k.json results/bench/peers_cpu_16k_32k_vmhwm.json
                                                                  # the docs' and README's tables from perf JSON

Both sides load one saved checkpoint and each measurement runs in a fresh process (keydiff/bench/peers_runner.py):
kvpress's in `.venv-kvpress` (keydiff.bench.peers_env), ours here. The JSON (--json) holds every value with its
provenance. Why a pair can differ: docs/peers.md.

Design: docs/design/benchmarks.md#against-kvpress-peers-peers_runner-peers_env
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from keydiff.bench import common, peers_env, runner

RUNNER = Path(__file__).with_name("peers_runner.py")
CONF = common.CHECKOUT / "conf" / "policy"
# --shape name -> keydiff.bench.common.RANDOM_MODELS entry (public architecture configs, no download).
SHAPES = {"smollm2-135m": "random-smollm2", "llama-3.2-3b": "random-llama-3.2-3b", "tiny": "random-tiny",
          "mid": "random-mid"}


@dataclass(frozen=True)
class PerfCase:
    """One row of the performance table: which side runs it, what its child is told (peers_runner's spec
    fields; ours block-wise also gets --block-size), and what its prompt forward computes logits for."""

    side: str
    spec: dict[str, Any]
    prompt_logits: str


# --cases names, in the table's order. kvpress's pipeline call is the ratio base (PERF_BASE).
PERF_CASES = {
    "kvpress_keydiff": PerfCase("kvpress", {"kvpress_call": "pipeline"}, "last"),
    "kvpress_keydiff_full_logits": PerfCase("kvpress", {"kvpress_call": "readme"}, "all L"),
    "keydiff_blockwise": PerfCase("keydiff", {}, "last"),
    "keydiff_one_block": PerfCase("keydiff", {"block_size": None}, "last"),
}
PERF_BASE = "kvpress_keydiff"


@dataclass(frozen=True)
class Pair:
    """A method both projects ship: our conf/policy preset (+ parameters set to kvpress's) and kvpress's press
    (a name in peers_runner.PRESSES)."""

    label: str
    ours: str
    press: str
    params: dict[str, Any] = field(default_factory=dict)


SNAPKV_AS_KVPRESS = {"window": 64, "kernel_size": 5, "pooling": "avg"}  # SnapKVPress's defaults
PAIRS = (
    Pair("keydiff", "keydiff", "keydiff"),
    Pair("knorm", "knorm", "knorm"),
    Pair("sink / streaming_llm", "sink", "streaming_llm", {"sinks": 4}),
    Pair("snapkv", "snapkv", "snapkv", SNAPKV_AS_KVPRESS),
    Pair("tova (one set per layer)", "tova", "tova", {"heads": "layer"}),
    Pair("expected_attention", "expected_attention", "expected_attention"),
    Pair("lagkv", "lagkv", "lagkv"),
    Pair("pyramidkv", "snapkv_pyramid", "pyramidkv",
         {**SNAPKV_AS_KVPRESS, "layer_budgets": {"schedule": "pyramid", "beta": 20, "window": 0}}),
    Pair("chunkkv", "chunkkv", "chunkkv", SNAPKV_AS_KVPRESS),
    Pair("adakv(keydiff)", "adakv_keydiff", "adakv_keydiff"),
    Pair("adakv(snapkv)", "adakv_snapkv", "adakv_snapkv", SNAPKV_AS_KVPRESS),
    Pair("adakv(expected_attention, eps 1e-2)", "adakv_expected_attention", "adakv_expected_attention"),
    Pair("criticalkv(snapkv)", "criticalkv", "critical_snapkv", SNAPKV_AS_KVPRESS),
    Pair("criticalkv adakv(snapkv)", "adakv_criticalkv", "critical_adakv_snapkv", SNAPKV_AS_KVPRESS),
)


def preset(name: str, conf: Path = CONF) -> tuple[str, dict[str, Any]]:
    """(policy name, parameters) of conf/policy/<name>.yaml, its `defaults` merged in first as Hydra does.

    Raises FileNotFoundError when the preset is not in this checkout (another branch adds it)."""
    from omegaconf import OmegaConf

    node = OmegaConf.load(conf / f"{name}.yaml")
    merged = OmegaConf.create({})
    for parent in node.get("defaults", []):
        if parent != "_self_":
            parent_name, parent_params = preset(parent, conf)
            merged = OmegaConf.merge(merged, {"name": parent_name, "params": parent_params})
    merged = OmegaConf.merge(merged, {k: v for k, v in node.items() if k != "defaults"})
    return str(merged.name), OmegaConf.to_container(merged.get("params", {}), resolve=True)


def our_policy(pair: Pair, conf: Path = CONF) -> tuple[str, dict[str, Any]] | None:
    """The policy and parameters that run our side of `pair`, or None where this checkout lacks it."""
    from keydiff import available_policies

    try:
        name, params = preset(pair.ours, conf)
    except FileNotFoundError:
        return None
    if name not in available_policies():
        return None
    return name, {**params, **pair.params}


def budget_problem(policy: tuple[str, dict[str, Any]], budget: int) -> str | None:
    """Why our side cannot run this policy at `budget` (its own one-line check), or None."""
    from keydiff import build_policy
    from keydiff.engine import check_budget

    try:
        check_budget(build_policy(policy[0], **policy[1]), budget)
    except ValueError as error:
        return str(error)
    return None


def overlap(ours: list[list[int]], theirs: list[list[int]]) -> dict[str, Any]:
    """Compare one layer's kept positions, per KV head ([head][positions]).
    layer: sum over heads of |ours_h ∩ theirs_h| / max(sum |ours_h|, sum |theirs_h|) (= the mean of
    |∩| / N over heads when both keep N per head; < 1 when the counts differ). head_min: the smallest
    per-head |∩| / max(|ours_h|, |theirs_h|). identical: every head keeps the same set."""
    if len(ours) != len(theirs):
        raise ValueError(f"{len(ours)} KV heads on our side, {len(theirs)} on kvpress's")
    common_counts, per_head = [], []
    for mine, other in zip(ours, theirs):
        shared = len(set(mine) & set(other))
        common_counts.append(shared)
        per_head.append(shared / max(len(mine), len(other), 1))
    ours_total, theirs_total = sum(map(len, ours)), sum(map(len, theirs))
    return {"layer": sum(common_counts) / max(ours_total, theirs_total, 1), "head_min": min(per_head),
            "identical": all(set(a) == set(b) for a, b in zip(ours, theirs)),
            "ours_entries": ours_total, "kvpress_entries": theirs_total}


def compare(ours: list[list[list[int]]], theirs: list[list[list[int]]]) -> dict[str, Any]:
    """Per layer overlaps (`overlap`) and their summary: mean and min over layers, min over heads."""
    if len(ours) != len(theirs):
        raise ValueError(f"{len(ours)} layers on our side, {len(theirs)} on kvpress's")
    layers = [overlap(a, b) for a, b in zip(ours, theirs)]
    return {"mean_overlap": statistics.fmean(l["layer"] for l in layers),
            "min_layer_overlap": min(l["layer"] for l in layers),
            "min_head_overlap": min(l["head_min"] for l in layers),
            "identical": all(l["identical"] for l in layers),
            "ours_entries": sum(l["ours_entries"] for l in layers),
            "kvpress_entries": sum(l["kvpress_entries"] for l in layers),
            "per_layer": [l["layer"] for l in layers]}


def parity_table(rows: list[dict[str, Any]]) -> str:
    """Markdown: one row per pair; "not available yet" for pairs this checkout lacks."""
    lines = ["| pair | ours | kvpress | mean overlap | min layer | min head | identical | entries ours / kvpress |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.get("status") != "ok":
            lines.append(f"| {r['pair']} | {r['ours']} | {r['press']} | {r['status']} | | | | |")
            continue
        c = r["comparison"]
        lines.append(f"| {r['pair']} | {r['ours']} | {r['press']} | {c['mean_overlap']:.3f} | "
                     f"{c['min_layer_overlap']:.3f} | {c['min_head_overlap']:.3f} | "
                     f"{'yes' if c['identical'] else 'no'} | {c['ours_entries']} / {c['kvpress_entries']} |")
    return "\n".join(lines)


def summarize_perf(samples: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, float]]:
    """Medians over rounds of TTFT, per-token decode time and peak bytes, per case."""
    keys = ("ttft_s", "per_token_s", "peak_bytes")
    return {case: {key: statistics.median(run[key] for run in runs) for key in keys}
            for case, runs in samples.items() if runs}


def perf_ratios(medians: dict[str, dict[str, float]], base: str = PERF_BASE) -> dict[str, dict[str, float]]:
    """Each other case's medians divided by the base case's (kvpress's pipeline call): < 1 means faster /
    smaller; None where the base was not measured."""
    reference = medians.get(base)
    return {case: {key: common.ratio(value, reference and reference.get(key)) for key, value in values.items()}
            for case, values in medians.items() if case != base}


def table_row(length: int, label: str, case: str, m: dict[str, float], r: dict[str, float | None]) -> str:
    """One case's row at one L: its medians `m` and their ratios `r` over the base case's."""
    return (f"| {length} | {label} | {PERF_CASES[case].prompt_logits} | {m['ttft_s']:.2f} | "
            f"{1000 * m['per_token_s']:.1f} | {m['peak_bytes'] / 1e9:.2f} | {common.fmt(r.get('ttft_s'), '.2f')} | "
            f"{common.fmt(r.get('per_token_s'), '.2f')} | {common.fmt(r.get('peak_bytes'), '.2f')} |")


def perf_table(by_length: dict[int, dict[str, dict[str, float]]]) -> str:
    """Markdown: per length and case, the medians and the ratios case / kvpress pipeline, then a note on
    the two kvpress calls (the "prompt logits" column: which positions the prompt forward computes logits for)."""
    lines = ["| L | method | prompt logits | TTFT s | decode ms/token | peak GB | TTFT × kvpress pipeline | "
             "decode × | peak × |", "|---|---|---|---|---|---|---|---|---|"]
    cases = set()
    for length, medians in by_length.items():
        ratios = perf_ratios(medians)
        for case, m in medians.items():
            cases.add(case)
            lines.append(table_row(length, case, case, m, ratios.get(case, {})))
    lines.append("")
    if PERF_BASE in cases:
        lines.append(f"Ratios: × {PERF_BASE}, kvpress's KeyDiffPress called as its pipeline calls the model "
                     "(logits of the last prompt position only).")
    else:
        lines.append(f"No ratios: their base, {PERF_BASE} (kvpress's pipeline call), was not measured.")
    if "kvpress_keydiff_full_logits" in cases:
        lines.append("kvpress_keydiff_full_logits: the same press under kvpress's README call "
                     "`model(input_ids=ids, past_key_values=cache)`, logits for all L prompt positions "
                     "(held until decoding ends).")
    return "\n".join(lines)


DOC_LABELS = {"kvpress_keydiff": "kvpress KeyDiffPress, pipeline call",
              "kvpress_keydiff_full_logits": "kvpress KeyDiffPress, README call",
              "keydiff_blockwise": "ours block-wise, B = {block_size}", "keydiff_one_block": "ours one block"}
README_CASE = "kvpress_keydiff_full_logits"
SETTING_KEYS = ("shape", "device", "threads", "dtype", "seed")
PERF_KEYS = ("budget", "block_size", "new_tokens")


def merged_medians(payloads: list[dict[str, Any]]) -> tuple[dict[int, dict[str, dict[str, float]]], dict[str, Any]]:
    """Per length, the medians of every perf JSON given (one --lengths set each), after checking they were
    measured in one setting; and that setting with the peak kinds found in their samples."""
    medians: dict[int, dict[str, dict[str, float]]] = {}
    settings = {(tuple(p[k] for k in SETTING_KEYS), tuple(p["perf"][k] for k in PERF_KEYS)) for p in payloads}
    if len(settings) != 1:
        raise ValueError(f"the files were measured in different settings ({', '.join(SETTING_KEYS + PERF_KEYS)}): "
                         f"{sorted(settings)}")
    kinds = set()
    for payload in payloads:
        for length, by_case in payload["perf"]["medians"].items():
            if int(length) in medians:
                raise ValueError(f"L = {length} is in more than one file")
            medians[int(length)] = by_case
        kinds |= {run["peak_kind"] for runs in payload["perf"]["samples"].values()
                  for samples in runs.values() for run in samples}
    first = payloads[0]
    return dict(sorted(medians.items())), {**{k: first[k] for k in SETTING_KEYS},
                                           **{k: first["perf"][k] for k in PERF_KEYS}, "peak_kinds": sorted(kinds)}


def doc_tables(payloads: list[dict[str, Any]]) -> tuple[str, str]:
    """(docs/performance.md's table, README's table) from perf JSON files: every case per L with its ratios
    over kvpress's pipeline call and, last column, its peak over the README call; README: kvpress's pipeline
    call -> ours block-wise (and the README call's peak)."""
    medians, setting = merged_medians(payloads)
    doc = ["| L | method | prompt logits | TTFT s | decode ms/token | peak GB | TTFT × | decode × | peak × | "
           "peak × README call |", "|---|---|---|---|---|---|---|---|---|---|"]
    readme = ["| L | TTFT kvpress → ours | × | peak memory kvpress pipeline / README call → ours | × | "
              "decode ms/token kvpress → ours |", "|---|---|---|---|---|---|"]
    for length, by_case in medians.items():
        ratios = {case: {k: 1.0 for k in by_case[PERF_BASE]} for case in [PERF_BASE] if case in by_case}
        ratios.update(perf_ratios(by_case))
        full = by_case.get(README_CASE, {}).get("peak_bytes")
        for case in (c for c in PERF_CASES if c in by_case):
            m = by_case[case]
            doc.append(table_row(length, DOC_LABELS[case].format(**setting), case, m, ratios.get(case, {}))
                       + f" {common.fmt(common.ratio(m['peak_bytes'], full), '.2f')} |")
        if PERF_BASE in by_case and "keydiff_blockwise" in by_case:
            base, ours = by_case[PERF_BASE], by_case["keydiff_blockwise"]
            peaks = f"{base['peak_bytes'] / 1e9:.2f}" + (f" / {full / 1e9:.2f}" if full else "")
            peak_ratios = f"{ours['peak_bytes'] / base['peak_bytes']:.2f}" + (
                f" / {ours['peak_bytes'] / full:.2f}" if full else "")
            readme.append(f"| {length:,} | {base['ttft_s']:.1f} → {ours['ttft_s']:.1f} s | "
                          f"{ours['ttft_s'] / base['ttft_s']:.2f} | {peaks} → {ours['peak_bytes'] / 1e9:.2f} GB | "
                          f"{peak_ratios} | {1000 * base['per_token_s']:.1f} → {1000 * ours['per_token_s']:.1f} |")
    note = (f"shape={setting['shape']} dtype={setting['dtype']} device={setting['device']} threads={setting['threads']} "
            f"N={setting['budget']} B={setting['block_size']} new_tokens={setting['new_tokens']}; "
            f"peak kinds: {', '.join(setting['peak_kinds'])}")
    return "\n".join(doc) + "\n\n" + note, "\n".join(readme)


def prose_numbers(payloads: list[dict[str, Any]]) -> str:
    """The numbers docs/performance.md's paragraphs under the table quote, per L: every case's TTFT range over
    rounds, ours block-wise in ms per prompt token, and TTFT and peak of ours block-wise over each kvpress call."""
    medians, _ = merged_medians(payloads)
    lines = []
    for payload in payloads:
        for length, by_case in payload["perf"]["samples"].items():
            ranges = ", ".join(f"{case} {min(r['ttft_s'] for r in runs):.1f}–{max(r['ttft_s'] for r in runs):.1f} s"
                               for case, runs in by_case.items() if runs)
            lines.append(f"L={length}: TTFT over {len(next(iter(by_case.values())))} round(s): {ranges}")
    for length, by_case in medians.items():
        ours = by_case.get("keydiff_blockwise")
        if not ours:
            continue
        over = "; ".join(f"over {case}: TTFT {ours['ttft_s'] / by_case[case]['ttft_s']:.2f}, peak "
                         f"{ours['peak_bytes'] / by_case[case]['peak_bytes']:.2f}" for case in (PERF_BASE, README_CASE)
                         if case in by_case)
        lines.append(f"L={length}: ours block-wise {1000 * ours['ttft_s'] / length:.2f} ms per prompt token; {over}")
    return "\n".join(lines)


def print_doc_tables(files: list[Path]) -> None:
    """`python -m keydiff.bench peers tables A.json [B.json ...]`: the tables of docs/performance.md's
    "Against kvpress" and README's, rendered from perf JSON files (the medians they hold), ready to paste."""
    payloads = [json.loads(f.read_text(encoding="utf-8")) for f in files]
    doc, readme = doc_tables(payloads)
    print(f"docs/performance.md:\n\n{doc}\n\nREADME.md:\n\n{readme}\n\nquoted in the prose:\n\n{prose_numbers(payloads)}")


def model_dir(shape: str, dtype: str, seed: int, cache_dir: Path) -> Path:
    """The shared checkpoint of `shape`: built once (random init with `seed`), saved as safetensors, reused."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = cache_dir / f"{shape}-seed{seed}-{dtype}"
    if (folder / "config.json").is_file() and (folder / "model.safetensors").is_file():
        return folder
    print(f"building random weights of {shape} (seed {seed}, {dtype}) in {folder}", flush=True)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**common.RANDOM_MODELS[SHAPES[shape]])).to(getattr(torch, dtype))
    scratch = Path(tempfile.mkdtemp(dir=cache_dir, prefix=f".{folder.name}-"))
    model.save_pretrained(scratch)
    scratch.rename(folder)  # complete folders only: a crash leaves a scratch folder, never a half checkpoint
    return folder


def run_child(side: str, spec: dict[str, Any], work: Path, kvpress_python: Path) -> dict[str, Any]:
    """One measurement in a fresh process; its JSON result. Raises with the child's stderr tail on failure."""
    index = len(list(work.glob("spec-*.json")))
    spec_file, out_file = work / f"spec-{index}.json", work / f"out-{index}.json"
    spec_file.write_text(json.dumps({**spec, "side": side}), encoding="utf-8")
    if side == "kvpress":
        command = [str(kvpress_python), "-I", str(RUNNER), str(spec_file), str(out_file)]
    else:
        command = [sys.executable, "-m", "keydiff.bench.peers_runner", str(spec_file), str(out_file)]
    env = {**os.environ, "OMP_NUM_THREADS": str(spec["threads"]),
           "PYTHONPATH": str(common.CHECKOUT)}
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"{side} child failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(out_file.read_text())


def logits_difference(a: dict[str, Any], b: dict[str, Any]) -> float:
    return max(abs(x - y) for x, y in zip(a["logits_check"], b["logits_check"]))


def run_parity(args, base: dict[str, Any], work: Path, kvpress_python: Path) -> list[dict[str, Any]]:
    rows = []
    checked = False
    for pair in PAIRS:
        if args.pairs and pair.ours not in args.pairs and pair.press not in args.pairs:
            continue
        row: dict[str, Any] = {"pair": pair.label, "ours": pair.ours, "press": pair.press}
        policy = our_policy(pair)
        if policy is None:
            print(f"{pair.label}: not available yet (no conf/policy/{pair.ours}.yaml policy in this checkout)")
            rows.append({**row, "status": "not available yet"})
            continue
        problem = budget_problem(policy, base["budget"])
        if problem:
            print(f"{pair.label}: ours cannot run at N = {base['budget']}: {problem}")
            rows.append({**row, "status": f"ours cannot run at N = {base['budget']}: {problem}"})
            continue
        print(f"{pair.label}: ours {policy[0]} {policy[1]} vs kvpress {pair.press} ...", flush=True)
        try:
            theirs = run_child("kvpress", {**base, "mode": "parity", "press": pair.press}, work, kvpress_python)
            mine = run_child("keydiff", {**base, "mode": "parity", "policy": policy[0], "params": policy[1]},
                             work, kvpress_python)
        except RuntimeError as error:
            print(error, file=sys.stderr)
            rows.append({**row, "status": f"failed: {str(error).splitlines()[0]}"})
            continue
        if not checked:
            print(f"logits check (same weights, first 16 prompt tokens): max |ours - kvpress| = "
                  f"{logits_difference(mine, theirs):.3g}", flush=True)
            checked = True
        row.update(status="ok", params=policy[1], compression_ratio=theirs["compression_ratio"],
                   press_repr=theirs["press_repr"], policy_repr=mine["policy_repr"],
                   logits_max_abs_diff=logits_difference(mine, theirs),
                   comparison=compare(mine["kept"], theirs["kept"]))
        c = row["comparison"]
        print(f"  mean overlap {c['mean_overlap']:.3f}, min head {c['min_head_overlap']:.3f}, identical "
              f"{'yes' if c['identical'] else 'no'}, entries {c['ours_entries']} / {c['kvpress_entries']}", flush=True)
        rows.append(row)
    return rows


def run_perf(args, base: dict[str, Any], work: Path, kvpress_python: Path) -> dict[str, Any]:
    samples: dict[int, dict[str, list]] = {L: {case: [] for case in args.cases} for L in args.lengths}
    for round_index in range(args.rounds):
        for length in args.lengths:
            for case in args.cases:
                side, extra = PERF_CASES[case].side, dict(PERF_CASES[case].spec)
                if side == "keydiff":
                    extra.setdefault("block_size", args.block_size)
                print(f"  round {round_index + 1}/{args.rounds}: L={length} {case} ...", file=sys.stderr, flush=True)
                spec = {**base, **extra, "mode": "perf", "prompt_file": str(work / f"prompt-{length}.json"),
                        "new_tokens": args.new_tokens, "warmup_tokens": min(256, length)}
                samples[length][case].append(run_child(side, spec, work, kvpress_python))
    first = samples[args.lengths[0]]
    by_side = {side: next((first[c][0] for c in args.cases if PERF_CASES[c].side == side), None)
               for side in ("keydiff", "kvpress")}
    if by_side["keydiff"] and by_side["kvpress"]:
        print(f"logits check (same weights, first 16 prompt tokens): max |ours - kvpress| = "
              f"{logits_difference(by_side['keydiff'], by_side['kvpress']):.3g}", flush=True)
    else:
        print("logits check: not possible (--cases measured one side only)", flush=True)
    medians = {L: summarize_perf(samples[L]) for L in args.lengths}
    return {"samples": samples, "medians": medians, "ratios": {L: perf_ratios(medians[L]) for L in args.lengths},
            "table": perf_table(medians)}


def write_prompt(path: Path, length: int, vocab: int, seed: int) -> dict[str, Any]:
    """Random token ids (keydiff.bench.common.random_prompt's draw) for both sides; their record (sha256)."""
    import torch

    ids = torch.randint(0, vocab, (1, length), generator=torch.Generator().manual_seed(seed))
    path.write_text(json.dumps(ids[0].tolist()), encoding="utf-8")
    return common.prompt_record(ids, seed)


def ratio_budget(ratio: float, length: int) -> int:
    """--ratio's N: ceil(ratio x L), at least 1, the rule of the runner's ratio budgets (budget=r0.25), so a
    parity row at --ratio r keeps what a leaderboard row at r keeps for a prompt of L tokens."""
    return max(1, math.ceil(ratio * length))


def check(args) -> None:
    """The arguments' combinations; the defaults that depend on the part and the device."""
    if args.part == "tables":
        missing = [str(f) for f in args.files if not f.is_file()]
        if not args.files or missing:
            raise ValueError(f"tables: name perf JSON files; no such file: {', '.join(missing) or '(none named)'}")
        without = [str(f) for f in args.files if "perf" not in json.loads(f.read_text(encoding="utf-8"))]
        if without:
            raise ValueError(f"no perf part in {', '.join(without)}")
        return
    if args.files:
        raise ValueError(f"files are named only by the tables part, not by {args.part}")
    try:
        args.lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--lengths must be a comma list of integers, got {args.lengths!r}") from None
    args.pairs = [p.strip() for p in args.pairs.split(",")] if args.pairs else None
    cases = {c.strip() for c in args.cases.split(",") if c.strip()}
    if cases - set(PERF_CASES):
        raise ValueError(f"unknown cases {sorted(cases - set(PERF_CASES))}; valid: {', '.join(PERF_CASES)}")
    if not cases:
        raise ValueError(f"--cases names no case; valid: {', '.join(PERF_CASES)}")
    args.cases = [c for c in PERF_CASES if c in cases]  # the table's order, whatever the order given
    known = {p.ours for p in PAIRS} | {p.press for p in PAIRS}
    if args.pairs and set(args.pairs) - known:
        raise ValueError(f"unknown pairs {sorted(set(args.pairs) - known)}; valid: {', '.join(sorted(known))}")
    if args.ratio is not None and not 0 < args.ratio <= 1:
        raise ValueError(f"--ratio must be in (0, 1], got {args.ratio}")
    if args.rounds < 1 or args.threads < 1:
        raise ValueError("--rounds and --threads must be >= 1")
    perf_budget = args.budget or 1024
    if args.part in ("perf", "all") and any(L <= perf_budget for L in args.lengths):
        raise ValueError(f"every --lengths value must exceed the budget N = {perf_budget}")
    args.json = Path(args.json or Path("results/bench") / time.strftime("peers-%Y%m%dT%H%M%SZ.json", time.gmtime()))
    if args.json.exists() and args.part != "env":
        raise ValueError(f"--json {args.json} exists; name a new file (results are never overwritten)")
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")


def run(args) -> None:
    from keydiff.models import cache_root

    if args.part == "tables":
        return print_doc_tables(args.files)
    if args.part == "env":
        return print(peers_env.build(args.env, args.torch_spec, args.kvpress_spec, args.dry_run))
    started = args.started
    kvpress = args.part != "perf" or any(PERF_CASES[c].side == "kvpress" for c in args.cases)
    kvpress_python = peers_env.build(args.env, args.torch_spec) if kvpress else None
    cache_dir = args.cache_dir or cache_root() / "peers"
    cache_dir.mkdir(parents=True, exist_ok=True)
    folder = model_dir(args.shape, args.dtype, args.seed, cache_dir)
    vocab = common.RANDOM_MODELS[SHAPES[args.shape]]["vocab_size"]
    base = {"model_dir": str(folder), "dtype": args.dtype, "device": args.device, "threads": args.threads}
    setting = (f"shape={args.shape} dtype={args.dtype} device={args.device} threads={args.threads} "
               f"seed={args.seed} weights={folder}")
    print(setting, flush=True)
    payload: dict[str, Any] = {"setting": setting, "shape": args.shape, "device": args.device,
                               "threads": args.threads, "dtype": args.dtype, "seed": args.seed,
                               "kvpress_env": (args.env / peers_env.MARKER).read_text().strip() if kvpress
                               else "not used: --cases of ours only"}
    with tempfile.TemporaryDirectory(prefix="keydiff-peers-") as tmp:
        work = Path(tmp)
        if args.part in ("parity", "all"):
            budget = ratio_budget(args.ratio, args.length) if args.ratio else (args.budget or 128)
            payload["parity_data"] = write_prompt(work / "prompt-parity.json", args.length, vocab, args.seed)
            spec = {**base, "budget": budget, "prompt_file": str(work / "prompt-parity.json")}
            print(f"parity: L = {args.length}, N = {budget}, whole prompt as one block", flush=True)
            rows = run_parity(args, spec, work, kvpress_python)
            payload["parity"] = {"length": args.length, "budget": budget, "rows": rows, "table": parity_table(rows)}
            print(payload["parity"]["table"], flush=True)
        if args.part in ("perf", "all"):
            payload["perf_data"] = [write_prompt(work / f"prompt-{length}.json", length, vocab, args.seed)
                                    for length in args.lengths]
            budget = args.budget or 1024
            print(f"perf: L in {args.lengths}, N = {budget}, B = {args.block_size}, {args.new_tokens} new tokens, "
                  f"{args.rounds} rounds, cases {', '.join(args.cases)}", flush=True)
            payload["perf"] = {"budget": budget, "block_size": args.block_size, "new_tokens": args.new_tokens,
                               "rounds": args.rounds, "cases": args.cases,
                               **run_perf(args, {**base, "budget": budget}, work, kvpress_python)}
            print(payload["perf"]["table"], flush=True)
    print(f"wrote {common.write_json(args.json, payload, started)}")


CASE = runner.Case("peers", run, __doc__, ("dtype", "threads", "device", "json", "length", "budget", "block_size",
                                           "new_tokens"), check=check,
                   defaults={"threads": 2, "device": "cpu", "length": 512, "budget": None, "new_tokens": 16}, options=(
    runner.option("part", nargs="?", default="all", choices=["parity", "perf", "all", "tables", "env"],
                  help="parity, perf or all (both); tables: the docs' tables from perf JSON files; env: build the "
                       "kvpress environment (keydiff.bench.peers_env) and print its python"),
    runner.option("files", nargs="*", type=Path, help="tables: perf JSON files of this command"),
    runner.option("--shape", default="smollm2-135m", choices=sorted(SHAPES)),
    runner.option("--seed", type=int, default=0, help="weights and prompt ids"),
    runner.option("--ratio", type=float, default=None, help="parity: N = ceil(ratio x L) instead of --budget"),
    runner.option("--pairs", default=None, help="parity: comma list of our presets or kvpress names (default all)"),
    runner.option("--lengths", default="4096,16384,32768", help="perf: comma list of prompt lengths"),
    runner.option("--cases", default=",".join(PERF_CASES),
                  help=f"perf: comma list of cases (default all: {', '.join(PERF_CASES)}); ours alone need no "
                       "kvpress environment"),
    runner.option("--rounds", type=int, default=3, help="perf: interleaved rounds (medians reported)"),
    runner.option("--cache-dir", type=Path, default=None, help="weights folder (default $KEYDIFF_CACHE/peers)"),
    runner.option("--env", type=Path, default=peers_env.DEFAULT_ENV, help="the kvpress environment"),
    runner.option("--torch-spec", default=peers_env.TORCH_SPEC, help="torch for a new kvpress environment"),
    runner.option("--kvpress-spec", default=peers_env.KVPRESS_SPEC, help="env: kvpress for a new environment"),
    runner.option("--dry-run", action="store_true", help="env: show what pip would install; write nothing")))


main = runner.entry(CASE, __spec__.name, __name__)  # `python -m keydiff.bench peers`: this case
