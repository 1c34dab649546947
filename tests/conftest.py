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


def char_tokenizer(chat_template: str | None = None, special: tuple[str, ...] = ()):
    """A one-character-per-token tokenizer with BOS `<s>`, built offline (task prompt tests)."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1}
    for char in [chr(i) for i in range(32, 127)] + ["\n"]:
        vocab[char] = len(vocab)
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>")
    if special:
        tokenizer.add_special_tokens({"additional_special_tokens": list(special)})
    tokenizer.chat_template = chat_template
    return tokenizer


@pytest.fixture(scope="session")
def model():
    return tiny_llama()


@pytest.fixture(scope="session")
def prompt():
    generator = torch.Generator().manual_seed(1)
    return torch.randint(0, 256, (1, 300), generator=generator)
