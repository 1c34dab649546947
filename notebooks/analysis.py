# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
# ---

# %% [markdown]
# # Why KeyDiff works: the paper's analyses on a real model
#
# A short walk through `keydiff.capture` and `keydiff.analysis.statistics` (the code behind
# `python -m keydiff.analysis.figures` and `python -m keydiff.analysis.table3`). It runs as a plain script
# (`PYTHONPATH=. python notebooks/analysis.py`) or, with jupytext installed, as a notebook
# (`jupytext --to notebook notebooks/analysis.py`). About a minute on a CPU with the offline default model.

# %%
import torch

from keydiff.analysis.statistics import (
    fit_pca, keydiff_attention_spearman, keydiff_score, log_volume, mean_cosine, pairwise_cosine, project,
    top_key_query_cosine,
)
from keydiff.capture import capture_prompt, trace_eviction
from keydiff.models import ModelConfig, load_model
from keydiff.tasks.haystack import load_haystack

torch.set_grad_enabled(False)
model, tokenizer = load_model(ModelConfig())  # SmolLM2-135M-Instruct, offline
text = load_haystack(None).text  # the NIAH haystack prose
ids = torch.tensor([tokenizer.bos_token_id] + tokenizer(text, add_special_tokens=False)["input_ids"][:1023])

# %% [markdown]
# ## 1. Capture keys, queries and attention (no eviction)
# One forward pass through a registered attention function: post-RoPE keys [H_kv, L, d] and queries
# [H, L, d] per layer, the attention each key receives (column sums, the last row) and the weights among
# the first 64 tokens.

# %%
captures = capture_prompt(model, ids, window=64)
c = captures[5]
print(c.keys.shape, c.queries.shape, c.received_sum.shape, c.window_weights.shape)

# %% [markdown]
# ## 2. Figure 2 / Table 3: distinct keys receive attention
# Keys with low cosine similarity to the others (high KeyDiff score) against the attention they receive.
# The top-scoring key is typically the most attended one (the sink); Table 3's Spearman rho measures the
# whole ranking.

# %%
cos = pairwise_cosine(c.keys[0, :64])
score = keydiff_score(c.keys)  # [H_kv, L] = -cos(k, mean of unit keys)
print("most distinct key per KV head:", score.argmax(-1).tolist())
print("most attended key per query head:", c.received_mean[:, :-32].argmax(-1).tolist())
rho = torch.stack([keydiff_attention_spearman(x.keys, x.received_mean) for x in captures])  # [layers, H]
print("Spearman rho per layer (mean over heads):", [round(v, 2) for v in rho.mean(1).tolist()])

# %% [markdown]
# ## 3. Figures 13-16: geometry of keys and queries
# Mean key vs mean query (negative in the paper), and the top KeyDiff key vs the mean query (positive).

# %%
mean_kq = torch.stack([mean_cosine(x.keys, x.queries) for x in captures])
top_q = torch.stack([top_key_query_cosine(x.keys, x.queries) for x in captures])
print(f"cos(mean key, mean query) < 0 in {(mean_kq < 0).float().mean():.0%} of heads")
print(f"cos(top KeyDiff key, mean query) > 0 in {(top_q > 0).float().mean():.0%} of heads")

# %% [markdown]
# ## 4. Figures 5, 8-10, 12: what each policy keeps
# A block-wise prefill with the engine (budget 256, B = 128) records what every policy evicts; the
# retained set is the engine's own. PCA coordinates share the basis of the un-evicted keys; the log
# volume of the retained keys is the log pseudo-determinant of K K^T (see `log_volume`).

# %%
pca = fit_pca(c.keys[0])
for policy in ("sink", "tova", "keydiff"):
    trace = trace_eviction(model, ids, policy, budget=256, block_size=128, layers=[5])[5]
    spread = project(trace.retained_keys[0], pca).std(0)
    volume = log_volume(trace.retained_keys).mean()
    print(f"{policy:8s} retained PCA spread {spread.tolist()}  mean log volume {volume:.1f}")
