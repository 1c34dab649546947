"""The paper's analysis figures, measured on a real model and real text, into results/figures/analysis/.

    python -m keydiff.analysis.figures [model=...] [length=2048] [cache_budget=512] [samples=2] [data.source=longbench]

Design: docs/design/reports.md#figures-reportfigures-analysisfigures
"""

from __future__ import annotations

import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from keydiff.analysis.common import (  # noqa: E402
    STYLE, config_from_command_line, figure_title, inputs_record, prompts, save_figure, titled,
)
from keydiff.analysis.statistics import (  # noqa: E402
    expand_to_query_heads, fit_pca, keydiff_score, log_volume, mean_cosine, pairwise_cosine,
    project, scaled_heads, top_key_query_cosine,
)
from keydiff.bench.common import CHECKOUT, provenance, write_json  # noqa: E402
from keydiff.capture import capture_prompt, trace_eviction  # noqa: E402
from keydiff.policies.keydiff import cosine_to_mean  # noqa: E402
from keydiff.models import load_model  # noqa: E402
from keydiff.paper.registry import display_name  # noqa: E402

RETAINED, EVICTED = "tab:blue", "tab:orange"
TOP_KEYS = 16  # highlighted top KeyDiff keys in Figures 4 / 11


def name(policy: str) -> str:
    """The paper's printed name of a policy (one map for tables and figures: keydiff.paper.registry)."""
    return display_name(policy)


def choose_heads(cfg, num_layers: int, kv_heads: int) -> dict[str, tuple[int, int]]:
    if cfg.heads is None:
        return scaled_heads(num_layers, kv_heads)
    chosen = {f"layer{int(l)}_head{int(h)}": (int(l), int(h)) for l, h in cfg.heads}
    bad = [pair for pair in chosen.values() if not (0 <= pair[0] < num_layers and 0 <= pair[1] < kv_heads)]
    if bad:
        raise ValueError(f"heads {bad} out of range: layers 0..{num_layers - 1}, KV heads 0..{kv_heads - 1}")
    return chosen




def figure2(captures, pairs, window: int):
    fig, axes = plt.subplots(len(pairs), 2, figsize=(6.4, 3.0 * len(pairs)), squeeze=False, layout="constrained")
    for row, (layer, head) in enumerate(pairs):
        capture = captures[layer]
        query_head = head * capture.group
        cos = pairwise_cosine(capture.keys[head, :window]).numpy()
        weights = capture.window_weights[query_head].numpy()
        image = axes[row][0].imshow(cos, cmap="coolwarm", vmin=-1, vmax=1, interpolation="nearest")
        fig.colorbar(image, ax=axes[row][0], shrink=0.8)
        axes[row][0].set_title(f"key cosine, layer {layer}, KV head {head}")
        image = axes[row][1].imshow(weights, cmap="viridis", interpolation="nearest")
        fig.colorbar(image, ax=axes[row][1], shrink=0.8)
        axes[row][1].set_title(f"attention, query head {query_head}")
        for ax in axes[row]:
            ax.set_xlabel("key")
        axes[row][0].set_ylabel("key")
        axes[row][1].set_ylabel("query")
    return fig


def pca_keys_queries(ax, capture, layer: int, head: int, anchor: str) -> None:
    keys = capture.keys[head]
    queries = capture.queries[head * capture.group]
    pca = fit_pca(torch.cat([keys, queries]))
    k2, q2 = project(keys, pca).numpy(), project(queries, pca).numpy()
    top = keydiff_score(keys, anchor).topk(min(TOP_KEYS, keys.shape[0])).indices.numpy()
    means = project(torch.stack([keys.mean(0), queries.mean(0)]), pca).numpy()
    ax.scatter(q2[:, 0], q2[:, 1], s=3, c="tab:green", alpha=0.4, label="queries", rasterized=True)
    ax.scatter(k2[:, 0], k2[:, 1], s=3, c="tab:blue", alpha=0.4, label="keys", rasterized=True)
    ax.scatter(k2[top, 0], k2[top, 1], s=14, c="tab:red", label=f"top {len(top)} KeyDiff keys")
    ax.scatter(*means[0], s=90, marker="*", c="black", label="mean key")
    ax.scatter(*means[1], s=60, marker="X", c="tab:purple", label="mean query")
    ax.set_title(f"layer {layer}, KV head {head} / query head {head * capture.group}")
    ax.set_xlabel(f"PC1 ({pca.explained[0]:.0%})")
    ax.set_ylabel(f"PC2 ({pca.explained[1]:.0%})")


def figure4(captures, pairs, anchor: str):
    columns = min(len(pairs), 2)
    rows = -(-len(pairs) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(3.6 * columns, 3.3 * rows), squeeze=False, layout="constrained")
    for ax, (layer, head) in zip(axes.flat, pairs):
        pca_keys_queries(ax, captures[layer], layer, head, anchor)
    for ax in list(axes.flat)[len(pairs):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=6, markerscale=1.5, loc="best")
    return fig


def figure_retained(capture, traces: dict, layer: int, head: int, budget: int):
    """(a..) one panel per policy: retained vs evicted keys; (last) the retained keys of every policy."""
    pca = fit_pca(capture.keys[head])
    policies = list(traces)
    fig, axes = plt.subplots(1, len(policies) + 1, figsize=(2.9 * (len(policies) + 1), 2.9), layout="constrained",
                             sharex=True, sharey=True)
    for ax, policy in zip(axes, policies):
        trace = traces[policy][layer]
        kept, dropped = project(trace.retained_keys[head], pca).numpy(), project(trace.evicted_keys[head], pca).numpy()
        ax.scatter(dropped[:, 0], dropped[:, 1], s=3, c=EVICTED, alpha=0.5, label=f"evicted ({len(dropped)})",
                   rasterized=True)
        ax.scatter(kept[:, 0], kept[:, 1], s=3, c=RETAINED, alpha=0.6, label=f"retained ({len(kept)})", rasterized=True)
        ax.set_title(name(policy))
        ax.legend(fontsize=6, markerscale=3, loc="best")
    for index, policy in enumerate(policies):
        kept = project(traces[policy][layer].retained_keys[head], pca).numpy()
        axes[-1].scatter(kept[:, 0], kept[:, 1], s=3, alpha=0.5, label=name(policy), c=f"C{index + 2}", rasterized=True)
    axes[-1].set_title("retained keys")
    axes[-1].legend(fontsize=6, markerscale=3, loc="best")
    for ax in axes:
        ax.set_xlabel(f"PC1 ({pca.explained[0]:.0%})")
    axes[0].set_ylabel(f"PC2 ({pca.explained[1]:.0%})")
    fig.suptitle(f"keys of layer {layer}, KV head {head}: budget {budget} of {capture.keys.shape[1]} tokens")
    return fig


def figure12(logdets: dict[str, np.ndarray], label: str):
    fig, ax = plt.subplots(figsize=(4.6, 3.0), layout="constrained")
    finite = {p: v[np.isfinite(v)] for p, v in logdets.items()}
    if not any(v.size for v in finite.values()):
        ax.text(0.5, 0.5, "every retained cache is singular (-inf)", ha="center", transform=ax.transAxes)
        return fig
    low = min(v.min() for v in finite.values() if v.size)
    high = max(v.max() for v in finite.values() if v.size)
    bins = np.linspace(low, high, 40)
    for index, (policy, values) in enumerate(finite.items()):
        ax.hist(values, bins=bins, alpha=0.5, color=f"C{index + 2}",
                label=f"{name(policy)} (median {np.median(values):.1f})")
    ax.set_xlabel(label)
    ax.set_ylabel("layers x KV heads x prompts")
    ax.legend(fontsize=7)
    return fig


def per_layer_boxes(ax, values: list[np.ndarray], ylabel: str) -> None:
    ax.boxplot(values, showfliers=False, widths=0.6)
    ax.set_xticks(range(1, len(values) + 1), [str(i) if i % 5 == 0 else "" for i in range(len(values))])
    ax.set_ylabel(ylabel)


def figure13(captures):
    fig, axes = plt.subplots(2, 1, figsize=(7.0, 4.6), layout="constrained", sharex=True)
    for ax, kind, field in zip(axes, ("key", "query"), ("keys", "queries")):
        cosines = [cosine_to_mean(getattr(c, field).float(), normalized=False).flatten().numpy() for c in captures]
        per_layer_boxes(ax, cosines, f"cos({kind}, mean {kind})")
    axes[1].set_xlabel("layer (all heads and tokens)")
    return fig


def heatmap(ax, grid: np.ndarray, title: str, fig) -> None:
    image = ax.imshow(grid.T, cmap="coolwarm", vmin=-1, vmax=1, aspect="auto", interpolation="nearest")
    ax.set_xlabel("layer")
    ax.set_ylabel("query head")
    ax.set_title(title)
    fig.colorbar(image, ax=ax, shrink=0.9)


def figure14(grid: np.ndarray):
    fig, ax = plt.subplots(figsize=(6.0, 2.8), layout="constrained")
    heatmap(ax, grid, "cos(mean key, mean query)", fig)
    return fig


def figure15(captures):
    fig, axes = plt.subplots(2, 1, figsize=(7.0, 4.6), layout="constrained", sharex=True)
    per_layer_boxes(axes[0], [c.keys.norm(dim=-1).flatten().numpy() for c in captures], "key L2 norm")
    per_layer_boxes(axes[1], [c.queries.norm(dim=-1).flatten().numpy() for c in captures], "query L2 norm")
    axes[1].set_xlabel("layer (all heads and tokens)")
    return fig


def figure16(top: np.ndarray, median: np.ndarray):
    fig, axes = plt.subplots(1, 2, figsize=(10.0, 2.8), layout="constrained")
    heatmap(axes[0], top, "cos(top KeyDiff key, mean query)", fig)
    heatmap(axes[1], median, "median over keys of cos(key, mean query)", fig)
    return fig




def median_key_query_cosine(capture) -> torch.Tensor:
    keys = expand_to_query_heads(capture.keys, capture.queries.shape[0])
    mean_query = capture.queries.mean(dim=1, keepdim=True)
    return torch.nn.functional.cosine_similarity(keys, mean_query, dim=-1).median(dim=-1).values


def main(argv: list[str]) -> None:
    started = provenance(__spec__.name, argv)
    cfg, model_cfg = config_from_command_line(argv, eviction=True)
    print(f"loading {cfg.model.name} to measure the analysis figures on {cfg.samples} prompt(s) of {cfg.length} "
          "tokens (make analysis, these figures then Table 3, default model on one CPU core: about 5 min)",
          flush=True)
    model, tokenizer = load_model(model_cfg)
    text_config = model.config.get_text_config()
    num_layers, kv_heads = text_config.num_hidden_layers, text_config.num_key_value_heads
    heads = choose_heads(cfg, num_layers, kv_heads)
    prompt_list, data = prompts(cfg, tokenizer, default_dataset="narrativeqa")
    too_short = [sid for sid, ids in prompt_list if ids.numel() <= cfg.cache_budget]
    if too_short:
        raise ValueError(f"prompts {too_short} are not longer than cache_budget={cfg.cache_budget}: nothing is evicted")
    out = CHECKOUT / cfg.figures_dir
    plt.rcParams.update(STYLE)
    paths: list[Path] = []
    first_only = figure_title(cfg, data, 1, budget=False)  # Figures 2, 4, 11, 13-16: the first prompt
    evicted = figure_title(cfg, data, 1)  # Figures 5, 8-10: the first prompt, evicted at the budget
    pooled = figure_title(cfg, data, len(prompt_list))  # Figure 12: every prompt
    titles: dict[str, str] = {}

    def save(fig, figure_name: str, title: str) -> list[Path]:
        titles[figure_name] = title
        return save_figure(titled(fig, title), out, figure_name, cfg.formats)

    first = prompt_list[0][1]
    print(f"capturing keys/queries/attention of {prompt_list[0][0]} ({first.numel()} tokens)", flush=True)
    captures = capture_prompt(model, first, window=cfg.window)
    pairs = list(dict.fromkeys(heads.values()))
    paths += save(figure2(captures, pairs[:2], cfg.window), "fig02_key_cosine_attention", first_only)
    paths += save(figure4(captures, pairs[:1], cfg.anchor), "fig04_pca_keys_queries", first_only)
    paths += save(figure4(captures, pairs, cfg.anchor), "fig11_pca_keys_queries", first_only)

    mean_kq = np.stack([mean_cosine(c.keys, c.queries).numpy() for c in captures])
    top_q = np.stack([top_key_query_cosine(c.keys, c.queries, cfg.anchor).numpy() for c in captures])
    median_q = np.stack([median_key_query_cosine(c).numpy() for c in captures])
    paths += save(figure13(captures), "fig13_cosine_to_mean", first_only)
    paths += save(figure14(mean_kq), "fig14_mean_key_query_cosine", first_only)
    paths += save(figure15(captures), "fig15_norms", first_only)
    paths += save(figure16(top_q, median_q), "fig16_top_key_mean_query", first_only)

    logdets: dict[str, list[float]] = {policy: [] for policy in cfg.policies}
    pca_layers = sorted({layer for layer, _ in pairs})
    first_traces: dict[str, list] = {}
    for index, (sample_id, ids) in enumerate(prompt_list):
        for policy in cfg.policies:
            print(f"  {sample_id}: {policy} at budget {cfg.cache_budget}, B = {cfg.block_size}", flush=True)
            traces = trace_eviction(model, ids, policy, cfg.cache_budget, cfg.block_size)
            for trace in traces:
                logdets[policy] += log_volume(trace.retained_keys, cfg.logdet_normalize, cfg.logdet_ridge).tolist()
            if index == 0:
                first_traces[policy] = [t if i in pca_layers else None for i, t in enumerate(traces)]
    for figure, (layer, head) in heads.items():
        fig = figure_retained(captures[layer], first_traces, layer, head, cfg.cache_budget)
        paths += save(fig, f"{figure}_pca_retained_layer{layer}_head{head}", evicted)
    label = "log det(K K^T + %g I)" % cfg.logdet_ridge if cfg.logdet_ridge > 0 else "log pdet(K K^T) = log det(K^T K)"
    label += " (unit keys)" if cfg.logdet_normalize else ""
    logdet_arrays = {p: np.array(v) for p, v in logdets.items()}
    paths += save(figure12(logdet_arrays, label), "fig12_logdet", pooled)

    key_cos = torch.cat([cosine_to_mean(c.keys.float(), normalized=False).flatten() for c in captures])
    query_cos = torch.cat([cosine_to_mean(c.queries.float(), normalized=False).flatten() for c in captures])
    key_norms = torch.cat([c.keys.norm(dim=-1).flatten() for c in captures])
    query_norms = torch.cat([c.queries.norm(dim=-1).flatten() for c in captures])
    results = {
        "titles": titles,
        "heads": {figure: list(pair) for figure, pair in heads.items()},
        "fig12_logdet": {p: {"median": float(np.median(v[np.isfinite(v)])), "mean": float(np.mean(v[np.isfinite(v)])),
                             "count": int(v.size), "non_finite": int((~np.isfinite(v)).sum())}
                         for p, v in logdet_arrays.items()},
        "fig12_label": label,
        "fig13_median_cos_key_to_mean": float(key_cos.median()),
        "fig13_median_cos_query_to_mean": float(query_cos.median()),
        "fig14_mean_key_query_cosine": {"mean": float(mean_kq.mean()), "share_negative": float((mean_kq < 0).mean())},
        "fig15_norm_cv": {"keys": float(key_norms.std() / key_norms.mean()),
                          "queries": float(query_norms.std() / query_norms.mean())},
        "fig16_top_key_mean_query": {"mean": float(top_q.mean()), "share_positive": float((top_q > 0).mean()),
                                     "median_key_mean": float(median_q.mean())},
    }
    summary = out / "summary.json"
    record = inputs_record(cfg, model_cfg, model, data, prompt_list, paths + [summary])
    record["results"] = results
    write_json(summary, record, started)
    for key, value in results.items():
        print(f"{key}: {value}")
    print(f"wrote {len(paths)} figure files ({', '.join(cfg.formats)}) and summary.json to {out}")


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main(sys.argv[1:])
