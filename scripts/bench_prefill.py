"""Prefill benchmark: time to first token per policy at one (prompt length, budget N, block size B).

Prints, for each policy, the median TTFT over repeats and the share of it spent computing attention
statistics and scoring/evicting (timed with GPU synchronisation, so those shares are honest on CUDA).
Runs on whatever device is available:

    python scripts/bench_prefill.py                                   # CPU: the offline default model
    python scripts/bench_prefill.py --model random-llama-3.2-3b --dtype bfloat16 --length 8192 --budget 2048
    python scripts/bench_prefill.py --attn eager --statistics materialized   # the paper's eager setting

`random-llama-3.2-3b` builds Llama-3.2-3B's public architecture with random weights (no download):
timings depend on shapes, not on weight values.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from keydiff import available_policies, build_policy, prefill  # noqa: E402

# Llama-3.2-3B(-Instruct) architecture, from its public config.json.
LLAMA_3_2_3B = dict(
    vocab_size=128256, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
    num_key_value_heads=8, head_dim=128, max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
    rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192},
    tie_word_embeddings=True, bos_token_id=128000, eos_token_id=[128001, 128008, 128009],
)
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=32768)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_model(name: str, dtype: torch.dtype, attn: str, device: str):
    if name in ("random-llama-3.2-3b", "random-tiny"):
        config = LlamaConfig(**(LLAMA_3_2_3B if name == "random-llama-3.2-3b" else TINY))
        torch.manual_seed(0)
        with torch.device(device):
            model = LlamaForCausalLM._from_config(config, attn_implementation=attn, dtype=dtype)
        return model.eval()
    from keydiff.models import ModelConfig, load_model

    cfg = ModelConfig.from_dict({"name": name, "path": "builtin:smollm2-135m" if name == "smollm2-135m" else name,
                                 "dtype": {v: k for k, v in DTYPES.items()}[dtype], "attn_implementation": attn,
                                 "max_length": 1 << 20, "device": device})
    cfg.validate()
    return load_model(cfg)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m", help="smollm2-135m | random-llama-3.2-3b | random-tiny | hub id/path")
    parser.add_argument("--policies", default="full,keydiff,sink,knorm,tova,snapkv,h2o")
    parser.add_argument("--length", type=int, default=4096, help="prompt tokens")
    parser.add_argument("--budget", type=int, default=1024)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--dtype", default=None, choices=list(DTYPES), help="default: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--attn", default="sdpa", choices=["sdpa", "eager", "flash_attention_2"])
    parser.add_argument("--statistics", default="fast", choices=["fast", "materialized"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None, help="also write the results to this JSON file")
    args = parser.parse_args()

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = DTYPES[args.dtype or ("bfloat16" if device == "cuda" else "float32")]
    names = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = [p for p in names if p not in available_policies()]
    if unknown:
        parser.error(f"unknown policies {unknown}; valid: {', '.join(available_policies())}")
    for name in names:
        build_policy(name).validate(args.budget)

    model = build_model(args.model, dtype, args.attn, device)
    vocab = model.config.get_text_config().vocab_size
    prompt = torch.randint(0, vocab, (1, args.length), generator=torch.Generator().manual_seed(0))
    header = (f"device={torch.cuda.get_device_name() if device == 'cuda' else 'cpu'} threads={torch.get_num_threads()} "
              f"model={args.model} dtype={str(dtype).removeprefix('torch.')} attn={args.attn} statistics={args.statistics} "
              f"L={args.length} N={args.budget} B={args.block_size}")
    print(header)
    prefill(model, prompt[:, : min(256, args.length)], "full", None, args.block_size)  # warm-up

    results = []
    print(f"{'policy':<18}{'TTFT s (median)':>16}{'min':>9}{'stats %':>9}{'evict %':>9}{'peak entries':>14}")
    for name in names:
        times, stats_share, evict_share, peak = [], [], [], 0
        for _ in range(args.repeats):
            if device == "cuda":
                torch.cuda.empty_cache()
            state = prefill(model, prompt, build_policy(name), args.budget, args.block_size,
                            attention_statistics=args.statistics, profile=True)
            times.append(state.seconds)
            stats_share.append(state.cache.timings["statistics_s"] / state.seconds)
            evict_share.append(state.cache.timings["eviction_s"] / state.seconds)
            peak = state.max_cache_entries
        row = {"policy": name, "ttft_median_s": statistics.median(times), "ttft_min_s": min(times),
               "statistics_share": statistics.median(stats_share), "eviction_share": statistics.median(evict_share),
               "peak_entries": peak}
        results.append(row)
        print(f"{name:<18}{row['ttft_median_s']:>16.3f}{row['ttft_min_s']:>9.3f}"
              f"{100 * row['statistics_share']:>8.1f}%{100 * row['eviction_share']:>8.1f}%{peak:>14}")
    if args.json:
        Path(args.json).write_text(json.dumps({"setting": header, "results": results,
                                               "time": time.strftime("%Y-%m-%dT%H:%M:%S")}, indent=2))


if __name__ == "__main__":
    main()
