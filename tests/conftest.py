"""Shared fixtures: a tiny randomly initialised Llama built from a config (no download, a few MB)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM


def tiny_llama(attn_implementation: str = "sdpa", dtype: torch.dtype = torch.float32, seed: int = 0, **overrides):
    """3 layers, 4 query heads sharing 2 KV heads (GQA group of 2), head_dim 16, random weights."""
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        **overrides,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM._from_config(config, attn_implementation=attn_implementation, dtype=dtype)
    return model.eval()


@pytest.fixture(scope="session")
def model():
    return tiny_llama()


@pytest.fixture(scope="session")
def prompt():
    generator = torch.Generator().manual_seed(1)
    return torch.randint(0, 256, (1, 300), generator=generator)
