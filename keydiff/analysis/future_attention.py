"""How well an attention-free policy's scores predict the attention the next queries really pay (real model).

Prefills the first L - T tokens of a NIAH prompt without eviction, scores every cached entry with each policy,
then runs the whole prompt with eager attention and averages the attention the last T queries give each of
those entries (over the queries, and over the query heads of each KV group). Prints the Spearman rank
correlation per layer (sinks excluded). Expected Attention is built to predict exactly this.

    OMP_NUM_THREADS=1 python -m keydiff.analysis.future_attention --context 1200 --future 200
"""

from __future__ import annotations

import argparse

import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import OmegaConf

import keydiff
from keydiff.analysis.statistics import spearman
from keydiff.bench.common import CHECKOUT
from keydiff.models import ModelConfig, load_model


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--context", type=int, default=1200, help="NIAH context length (task.context_lengths)")
    parser.add_argument("--future", type=int, default=200, help="T: the last T prompt tokens act as future queries")
    parser.add_argument("--policies", default="expected_attention,knorm,keydiff")
    args = parser.parse_args(argv)
    names = args.policies.split(",")
    unknown = [name for name in names if name not in keydiff.available_policies()]
    if unknown:
        parser.error(f"unknown policies {unknown}; valid: {', '.join(keydiff.available_policies())}")
    if not 0 < args.future < args.context:
        parser.error(f"--future must be between 1 and --context - 1, got {args.future}")
    with initialize_config_dir(str(CHECKOUT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[f"model={args.model}", f"task.context_lengths=[{args.context}]", "task.depths=[50]"])
    model, tokenizer = load_model(ModelConfig.from_dict(OmegaConf.to_container(cfg.model, resolve=True)))
    task = instantiate(cfg.task, _convert_="all")
    ids = torch.tensor([task.build_prompt(next(iter(task.samples())), tokenizer, None).input_ids])
    cut = ids.shape[1] - args.future
    policies = [keydiff.build_policy(name, **({"n_future_positions": args.future} if name == "expected_attention" else {}))
                for name in names]
    state = keydiff.prefill(model, ids[:, :cut], policies[0], budget=cut + 1, block_size=128)  # no eviction
    original = model.config._attn_implementation
    model.set_attn_implementation("eager")
    with torch.no_grad():
        attentions = model(ids, output_attentions=True).attentions
    model.set_attn_implementation(original)
    print(f"prompt {ids.shape[1]} tokens; scores after {cut}, attention of the last {args.future} queries")
    print("layer  " + "  ".join(f"{name:>18}" for name in names))
    for index, layer in enumerate(state.cache.layers):
        view = layer.view(index)
        kv_heads = view.keys.shape[1]
        received = attentions[index][0, :, cut:, :cut].mean(dim=1)  # [H, cut] by position
        received = received.view(kv_heads, -1, cut).mean(dim=1)
        row = []
        for policy in policies:
            scores = policy.score(view)[0]
            values = []
            for head in range(kv_heads):
                positions = view.positions[0, head]
                keep = positions >= 4
                values.append(float(spearman(scores[head][keep].double(), received[head][positions][keep].double())))
            row.append(sum(values) / kv_heads)
        print(f"{index:5d}  " + "  ".join(f"{value:+18.2f}" for value in row))


if __name__ == "__main__":
    main()
