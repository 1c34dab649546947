"""keydiff-bench: KV-cache eviction under block-wise prompt processing.

    import keydiff
    model, tokenizer = keydiff.load_model("smollm2-135m")    # or a Hub id / checkpoint folder
    policy = keydiff.build_policy("keydiff", window_fraction=0.2)
    state = keydiff.prefill(model, input_ids, policy, budget=2048, block_size=128)
    out = keydiff.generate(model, state, max_new_tokens=64, eos_token_ids=keydiff.eos_token_ids(model, tokenizer))
    text = tokenizer.decode(out.token_ids[0], skip_special_tokens=True)

Public names are imported on first use (PEP 562), so `import keydiff` (and run.py's config checks) do not
import torch. The API: docs/api.md.
"""

from importlib import import_module

from keydiff.config import register_resolvers

register_resolvers()

__version__ = "0.1.0"

_EXPORTS = {
    "attention_statistic": "keydiff.attention",
    "keydiff_attention": "keydiff.attention",
    "BatchCache": "keydiff.decode",
    "Decoder": "keydiff.decode",
    "Failure": "keydiff.decode",
    "Job": "keydiff.decode",
    "Request": "keydiff.decode",
    "SequenceResult": "keydiff.decode",
    "generate_batch": "keydiff.decode",
    "EvictingCache": "keydiff.cache",
    "EvictingLayer": "keydiff.cache",
    "GenerationResult": "keydiff.engine",
    "PrefillOptions": "keydiff.engine",
    "PrefillResult": "keydiff.engine",
    "copy_state": "keydiff.engine",
    "feed": "keydiff.engine",
    "follow_up": "keydiff.engine",
    "generate": "keydiff.engine",
    "prefill": "keydiff.engine",
    "resolve_block_size": "keydiff.engine",
    "POLICIES": "keydiff.policies",
    "Needs": "keydiff.policies",
    "Policy": "keydiff.policies",
    "available_policies": "keydiff.policies",
    "build_policy": "keydiff.policies",
    "layer_by_layer": "keydiff.policies",
    "ModelConfig": "keydiff.models",
    "eos_token_ids": "keydiff.models",
    "load_model": "keydiff.models",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'keydiff' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + __all__)
