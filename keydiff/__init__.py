"""keydiff-bench: KV-cache eviction under block-wise prompt processing.

    import keydiff
    policy = keydiff.build_policy("keydiff", window_fraction=0.2)
    state = keydiff.prefill(model, input_ids, policy, budget=2048, block_size=128)
    out = keydiff.generate(model, state, max_new_tokens=64, eos_token_ids=[tokenizer.eos_token_id])

`state.logits` are the next-token logits after the prompt, `state.cache` the bounded transformers Cache,
`state.kept_positions` the absolute prompt positions each layer and KV head kept.
"""

from keydiff.config import register_resolvers

register_resolvers()

from keydiff.attention import attention_statistic, keydiff_attention  # noqa: E402
from keydiff.cache import EvictingCache, EvictingLayer  # noqa: E402
from keydiff.engine import GenerationResult, PrefillResult, generate, prefill, resolve_block_size  # noqa: E402
from keydiff.policies import POLICIES, Policy, available_policies, build_policy  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "EvictingCache",
    "EvictingLayer",
    "GenerationResult",
    "POLICIES",
    "Policy",
    "PrefillResult",
    "attention_statistic",
    "available_policies",
    "build_policy",
    "generate",
    "keydiff_attention",
    "prefill",
    "resolve_block_size",
]
