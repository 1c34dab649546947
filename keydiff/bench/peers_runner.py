"""One measurement of `python -m keydiff.bench peers`, in a fresh process, for either project.

    <.venv-kvpress>/bin/python -I keydiff/bench/peers_runner.py SPEC.json OUT.json    # kvpress's side
    <.venv>/bin/python -m keydiff.bench.peers_runner SPEC.json OUT.json               # this project's side

No `keydiff` import at the top: keydiff cannot be imported in kvpress's environment (keydiff/device.py and
keydiff/run/memory.py are loaded by path).
Design: docs/design/benchmarks.md#against-kvpress-peers-peers_runner-peers_env
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch

# kvpress presses by the name keydiff.bench.peers.PAIRS uses: (class, keyword arguments), a nested tuple being a
# wrapped press; parameters are kvpress's defaults unless written here.
PRESSES: dict[str, tuple] = {
    "keydiff": ("KeyDiffPress", {}),
    "knorm": ("KnormPress", {}),
    "streaming_llm": ("StreamingLLMPress", {"n_sink": 4}),
    "snapkv": ("SnapKVPress", {}),  # window_size 64, kernel_size 5
    "tova": ("TOVAPress", {}),
    "expected_attention": ("ExpectedAttentionPress", {}),
    "lagkv": ("LagKVPress", {}),  # n_sink 4, lag_size 128
    "pyramidkv": ("PyramidKVPress", {}),  # SnapKV scores, window 64, kernel 5, beta 20
    "chunkkv": ("ChunkKVPress", {"press": ("SnapKVPress", {}), "chunk_length": 20}),
    "adakv_keydiff": ("AdaKVPress", {"press": ("KeyDiffPress", {})}),
    "adakv_snapkv": ("AdaKVPress", {"press": ("SnapKVPress", {})}),
    # the registry's "expected_attention": AdaKV over ExpectedAttention with epsilon 1e-2
    "adakv_expected_attention": ("AdaKVPress", {"press": ("ExpectedAttentionPress", {"epsilon": 1e-2})}),
    "critical_snapkv": ("CriticalKVPress", {"press": ("SnapKVPress", {})}),
    "critical_adakv_snapkv": ("CriticalAdaKVPress", {"press": ("SnapKVPress", {})}),
}


# How the kvpress side calls the model over the prompt (under the press): "pipeline" as kvpress's pipeline (no
# [L, vocab] logits: logits_to_keep=1); "readme" as kvpress's README, logits for every prompt position, held.
KVPRESS_CALLS = ("pipeline", "readme")


def cache_argument(model, cache) -> dict[str, Any]:
    """`{keyword: cache}` for a forward call: `cache` where the model's forward takes it (transformers >= 5.24),
    else `past_key_values` (kvpress's pinned transformers, where `cache=` would vanish into **kwargs)."""
    return {"cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values": cache}


def build_press(name: str, compression_ratio: float):
    """The kvpress press called `name` in PRESSES, with the compression ratio set on it (wrappers forward it)."""
    import kvpress

    def make(spec):
        cls, kwargs = spec
        return getattr(kvpress, cls)(**{k: make(v) if isinstance(v, tuple) else v for k, v in kwargs.items()})

    press = make(PRESSES[name])
    press.compression_ratio = compression_ratio
    return press


def compression_ratio_for(length: int, budget: int) -> float:
    """kvpress's r (the fraction REMOVED) for which it keeps exactly `budget` of `length` entries. kvpress keeps
    int(length * (1 - r)); 1 - budget/length can round one short (0.3 * 10 = 2.9999...), so r is nudged down by ulps
    until the product reaches the budget."""
    if not 0 < budget <= length:
        raise ValueError(f"budget {budget} must be in 1..{length} (the prompt length)")
    ratio = 1.0 - budget / length
    while int(length * (1 - ratio)) < budget:
        ratio = math.nextafter(ratio, -math.inf)
    return max(ratio, 0.0)


def load_model(spec: dict[str, Any]):
    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, spec["dtype"])
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=dtype, attn_implementation="sdpa")
    return model.to(spec["device"]).eval()


def load_by_path(relative: str):
    """A keydiff file that imports no keydiff (keydiff/device.py, keydiff/run/memory.py), loaded by its path:
    kvpress's environment cannot import the keydiff package."""
    path = Path(__file__).resolve().parents[1] / relative
    spec = importlib.util.spec_from_file_location(f"keydiff_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


device_calls = load_by_path("device.py")
memory = load_by_path("run/memory.py")
sync = device_calls.sync


def reset_peak(device: str) -> None:
    """Restart the peak count so that it covers what follows, not the model load."""
    device_calls.release_memory(device)
    memory.reset_peak(device)


def peak_bytes(device: str) -> dict[str, Any]:
    return dict(zip(("peak_bytes", "peak_kind"), memory.peak_memory(device)))


@torch.inference_mode()
def check_logits(model, ids: torch.Tensor) -> list[float]:
    """Last-position logits of a short input (the first 16 prompt tokens, no cache): both sides must agree."""
    return model(ids[:, :16]).logits[0, -1, :8].float().tolist()


class KeptRecorder:
    """Which prompt positions a press kept, read from the cache around kvpress's own forward hook.
    A hook registered BEFORE the press's hook copies each layer's full keys; one registered AFTER it reads
    what the press left: for a press that prunes, each kept key row is found (bitwise) among the copied
    rows; for a masking press (AdaKV, CriticalAdaKV: `module.masked_key_indices`), kept = not masked."""

    def __init__(self, layers):
        self.layers = layers
        self.full: dict[int, torch.Tensor] = {}
        self.kept: dict[int, list[list[int]]] = {}

    def before(self, module, args, kwargs, output):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        self.full[module.layer_idx] = cache.layers[module.layer_idx].keys[0].detach().clone()

    def after(self, module, args, kwargs, output):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        full = self.full.pop(module.layer_idx)
        masked = getattr(module, "masked_key_indices", None)
        if masked is not None:
            batch, head, seq = masked
            keep = torch.ones(full.shape[:2], dtype=torch.bool)
            keep[head[batch == 0].cpu(), seq[batch == 0].cpu()] = False
            self.kept[module.layer_idx] = [torch.nonzero(row).flatten().tolist() for row in keep]
            module.masked_key_indices = None
            return
        self.kept[module.layer_idx] = [
            match_rows(full[h], cache.layers[module.layer_idx].keys[0, h]) for h in range(full.shape[0])
        ]


def match_rows(full: torch.Tensor, kept: torch.Tensor) -> list[int]:
    """Sorted indices in `full` [n, d] of the rows of `kept` [k, d], matched bitwise (a gather copies bits)."""
    as_bits = lambda t: [bytes(row) for row in t.detach().cpu().contiguous().view(torch.uint8).numpy()]
    where = {}
    for index, row in enumerate(as_bits(full)):
        if row in where:
            raise ValueError("two cached keys are bitwise equal: kept positions cannot be recovered")
        where[row] = index
    return sorted(where[row] for row in as_bits(kept))


@torch.inference_mode()
def kvpress_parity(model, ids: torch.Tensor, spec: dict[str, Any]) -> dict[str, Any]:
    from transformers import DynamicCache

    ratio = compression_ratio_for(ids.shape[1], spec["budget"])
    press = build_press(spec["press"], ratio)
    layers = model.model.layers
    recorder = KeptRecorder(layers)
    hooks = [layer.self_attn.register_forward_hook(recorder.before, with_kwargs=True) for layer in layers]
    try:
        with press(model):
            hooks += [layer.self_attn.register_forward_hook(recorder.after, with_kwargs=True) for layer in layers]
            # as kvpress's pipeline: the base model
            model.model(input_ids=ids, **cache_argument(model.model, DynamicCache()))
    finally:
        for hook in hooks:
            hook.remove()
    return {"compression_ratio": ratio, "press_repr": repr(press),
            "kept": [recorder.kept[i] for i in range(len(layers))]}


@torch.inference_mode()
def kvpress_generate(model, ids: torch.Tensor, spec: dict[str, Any]) -> dict[str, Any]:
    """KeyDiffPress: one forward of the whole prompt under the press (called as spec["kvpress_call"] says,
    see KVPRESS_CALLS), then greedy decoding outside it (the cache is never compressed again), positions
    continuing after the prompt, last-position logits only. The prompt forward's output stays alive until
    decoding ends, as a user's `out` would: with the README call its [L, vocab] logits count in the peak."""
    from transformers import DynamicCache

    call = spec.get("kvpress_call", "pipeline")
    if call not in KVPRESS_CALLS:
        raise ValueError(f"kvpress_call {call!r} is not valid; valid: {', '.join(KVPRESS_CALLS)}")
    device, length = spec["device"], ids.shape[1]
    press = build_press("keydiff", compression_ratio_for(length, spec["budget"]))
    cache = DynamicCache()
    sync(device)
    start = time.perf_counter()
    with press(model):
        if call == "readme":
            prompt_out = model(input_ids=ids, **cache_argument(model, cache))
        else:
            prompt_out = model(input_ids=ids, **cache_argument(model, cache), logits_to_keep=1)
    sync(device)
    ttft = time.perf_counter() - start
    entries = cache.get_seq_length()
    token = prompt_out.logits[:, -1].argmax(-1, keepdim=True)
    tokens = [token]
    start = time.perf_counter()
    for step in range(spec["new_tokens"] - 1):
        position = torch.tensor([[length + step]], device=ids.device)
        logits = model(input_ids=token, **cache_argument(model, cache), position_ids=position,
                       logits_to_keep=1).logits[:, -1]
        token = logits.argmax(-1, keepdim=True)
        tokens.append(token)
    sync(device)
    decode_s = time.perf_counter() - start
    return {"ttft_s": ttft, "decode_s": decode_s, "cache_entries": entries, "kvpress_call": call,
            "prompt_logits_shape": list(prompt_out.logits.shape), "tokens": torch.cat(tokens, -1)[0].tolist()}


def keydiff_parity(model, ids: torch.Tensor, spec: dict[str, Any]) -> dict[str, Any]:
    from keydiff import build_policy, prefill

    policy = build_policy(spec["policy"], **spec.get("params", {}))
    state = prefill(model, ids, policy, spec["budget"], None)
    return {"policy_repr": repr(policy), "kept": [per_head_positions(layer) for layer in state.kept_positions]}


def per_head_positions(layer) -> list[list[int]]:
    """Batch row 0's kept positions per KV head, sorted; negative entries (padding of unequal heads) dropped."""
    heads = layer[0] if isinstance(layer, torch.Tensor) else [h[0] if h.dim() > 1 else h for h in layer]
    return [sorted(p for p in head.flatten().tolist() if p >= 0) for head in heads]


def keydiff_generate(model, ids: torch.Tensor, spec: dict[str, Any]) -> dict[str, Any]:
    from keydiff import build_policy, generate, prefill

    state = prefill(model, ids, build_policy("keydiff"), spec["budget"], spec["block_size"])
    result = generate(model, state, spec["new_tokens"], eos_token_ids=(), evict=True)
    return {"ttft_s": state.seconds, "decode_s": result.seconds, "cache_entries": state.max_cache_entries}


def run(spec: dict[str, Any]) -> dict[str, Any]:
    torch.set_num_threads(spec["threads"])
    model = load_model(spec)
    ids = torch.tensor([json.loads(Path(spec["prompt_file"]).read_text())], device=spec["device"])
    out: dict[str, Any] = {"logits_check": check_logits(model, ids), "torch": torch.__version__,
                           "threads": torch.get_num_threads()}
    import transformers

    out["transformers"] = transformers.__version__
    kvpress = spec["side"] == "kvpress"
    if kvpress:
        import importlib.metadata

        out["kvpress"] = importlib.metadata.version("kvpress")
    if spec["mode"] == "parity":
        out.update(kvpress_parity(model, ids, spec) if kvpress else keydiff_parity(model, ids, spec))
        return out
    measure = kvpress_generate if kvpress else keydiff_generate
    measure(model, ids[:, : spec["warmup_tokens"]], {**spec, "budget": min(spec["budget"], spec["warmup_tokens"] // 2)})
    reset_peak(spec["device"])
    out.update(measure(model, ids, spec))
    out["per_token_s"] = out["decode_s"] / max(spec["new_tokens"] - 1, 1)
    out.update(peak_bytes(spec["device"]))
    return out


def main(argv: list[str]) -> None:
    spec_path, out_path = argv
    result = run(json.loads(Path(spec_path).read_text()))
    Path(out_path).write_text(json.dumps(result) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main(sys.argv[1:])
