"""Shared fixtures: a tiny randomly initialised Llama built from a config (no download, a few MB).

Before anything imports torch, the tests' OpenMP settings go into the environment where the user set none
(keydiff.openmp.DEFAULTS["test"]), and every subprocess a test starts inherits them. torch and transformers
are imported where a fixture needs them, so a file that needs neither (tests/test_docs.py) starts without them.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any, Iterator

import pytest

from keydiff import openmp
from keydiff.tasks.base import GenerationSettings, Prompt, Sample, Task

openmp.prepare("test")  # before torch is imported (none of the imports above does): OpenMP reads it then


def tiny_llama(attn_implementation: str = "sdpa", dtype=None, seed: int = 0, **overrides):
    """3 layers, 4 query heads sharing 2 KV heads (GQA group of 2), head_dim 16, random weights (float32 unless
    `dtype`)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 4096,
        **overrides,
    })
    torch.manual_seed(seed)
    model = LlamaForCausalLM._from_config(config, attn_implementation=attn_implementation, dtype=dtype or torch.float32)
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


# A test is marked `real_model` (pyproject.toml) by its own decorator, or here, by using a fixture that needs the
# real offline default model (weights or tokenizer), so that `-m "not real_model"` leaves it out as well.
# make test-quick runs a policy-by-policy check on the paper's methods only; every other case of the same check
# is marked `extended` (make test runs all of them). One list, so the quick set does not drift file by file.
CORE_POLICIES = ("full", "keydiff", "h2o", "tova", "snapkv", "sink", "knorm")


def extended_unless(cases, core, ids=None) -> list:
    """`cases` as pytest params, those for which `core(case)` is false marked `extended` (left out of
    make test-quick, run by make test). A tuple case is unpacked into the test's several arguments."""
    ids = ids if ids is not None else [None] * len(cases)
    return [pytest.param(*(case if isinstance(case, tuple) else (case,)), id=id_,
                         marks=() if core(case) else (pytest.mark.extended,)) for case, id_ in zip(cases, ids)]


REAL_MODEL_FIXTURES = ("builtin_tokenizer",)

# Every test is in exactly one tier (pyproject.toml's markers; docs/testing.md): `unit`, `integration` or `slow`.
# A test file names its tier in `pytestmark`; a test of another tier in it says so in its own decorator, which
# wins. A test that uses the real model or the real scheduler is `slow` whatever its file says. `device` (any
# tier but slow) may be added: the test takes its device from the `device` fixture (pytest --device).
TIERS = ("unit", "integration", "slow")
SLOW_MARKS = ("real_model", "slurm")


def pytest_addoption(parser):
    parser.addoption("--device", default="cpu",
                     help="the device the tests marked `device` run on (torch device string: cpu, cuda, cuda:1)")


def pytest_configure(config):
    """On a CPU, Triton kernels (keydiff.kernels: tests/test_batch_invariant.py) run on CPU tensors in Triton's
    interpreter; on a GPU (--device cuda) they must be compiled. keydiff.kernels reads TRITON_INTERPRET when it
    is imported, after this (no test module is imported yet, and nothing here imports torch or triton)."""
    if hasattr(config, "workerinput"):  # an xdist worker: the files heaviest first (XdistOrder)
        config.pluginmanager.register(XdistOrder(), "keydiff_xdist_order")
    device = config.getoption("--device")
    if not re.fullmatch(r"(cpu|cuda|mps|xpu)(:\d+)?", device):
        raise pytest.UsageError(f"--device {device!r} is not a device; valid: cpu, cuda, cuda:N, mps, xpu")
    if device.startswith("cpu"):
        os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def device(request):
    """The torch device of a `device` test: pytest's --device (default cpu)."""
    import torch

    return torch.device(request.config.getoption("--device"))


def tier_of(item) -> tuple[str | None, str]:
    """(the item's tier, the problem) with its markers as written: the nearest node's tier mark wins (the test's,
    then its class's, then its module's); a real-model or real-SLURM test is slow."""
    slow = next((name for name in SLOW_MARKS if item.get_closest_marker(name)), None)
    for node in reversed(item.listchain()):
        marked = {mark.name for mark in node.own_markers if mark.name in TIERS}
        if len(marked) > 1:
            return None, f"marked {' and '.join(sorted(marked))}: one tier only"
        if marked:
            tier = marked.pop()
            if slow and tier != "slow" and node is item:
                return None, f"marked {tier} but {slow}: slow"
            return ("slow" if slow else tier), ""
    return ("slow", "") if slow else (None, f"no tier: mark its file (pytestmark) or itself {', '.join(TIERS)}")


@pytest.hookimpl(tryfirst=True)  # before -m deselects and before xdist reads xdist_group
def pytest_collection_modifyitems(config, items):
    problems, parents = [], set()
    for item in items:
        if any(name in item.fixturenames for name in REAL_MODEL_FIXTURES):  # the fixtures it uses, transitively
            item.add_marker(pytest.mark.real_model)
        tier, problem = tier_of(item)
        if problem:
            problems.append(f"{item.nodeid}: {problem}")
            continue
        if item.get_closest_marker("device") and tier == "slow":
            problems.append(f"{item.nodeid}: marked device but slow: a device test runs in this process, on no real model")
        if not any(mark.name == tier for mark in item.own_markers):
            item.add_marker(getattr(pytest.mark, tier))
        parents.update(node for node in item.listchain() if node is not item)
    for node in parents:  # each test now holds its one tier itself; -m reads the markers of every node above it
        node.own_markers[:] = [mark for mark in node.own_markers if mark.name not in TIERS]
    if problems:
        raise pytest.UsageError("tests not in exactly one tier (unit, integration, slow; tests/conftest.py):\n  "
                                + "\n  ".join(problems[:20]) + (f"\n  ... {len(problems) - 20} more" if len(problems) > 20 else ""))


# make test (pytest-xdist, --dist loadfile --no-loadscope-reorder) hands each worker whole files in collection
# order. A worker holds one file and the next, so a file of minutes that comes last keeps one worker busy after the
# other has finished: xdist's own order, most tests first, put the five real-SLURM tests (minutes of waiting) last.
# The workers therefore collect the files heaviest first, by a rough cost per test of each tier (seconds, one CPU),
# and keep each file's own order. A serial run keeps the order of the files on disk.
TIER_COST_S = {"unit": 0.02, "integration": 0.3, "slow": 10.0, "slurm": 60.0}


def cost_s(item) -> float:
    """The rough seconds a test takes, by its tier (a real-SLURM test: its own, the longest)."""
    if item.get_closest_marker("slurm"):
        return TIER_COST_S["slurm"]
    return next((TIER_COST_S[mark.name] for mark in item.own_markers if mark.name in TIERS), TIER_COST_S["unit"])


def heaviest_files_first(items: list) -> None:
    """Sorts `items` (in place) by their file's summed `cost_s`, most first; within a file, its own order."""
    def file(item) -> str:
        return item.nodeid.split("::")[0]

    cost: dict[str, float] = {}
    for item in items:
        cost[file(item)] = cost.get(file(item), 0.0) + cost_s(item)
    items.sort(key=lambda item: -cost[file(item)])


class XdistOrder:
    """In an xdist worker: the selected tests (after -m and -k), heaviest files first (`heaviest_files_first`)."""

    @pytest.hookimpl(trylast=True)  # after -m / -k deselect, so the cost counts only the tests that run
    def pytest_collection_modifyitems(self, items):
        heaviest_files_first(items)


@pytest.fixture(scope="session")
def builtin_tokenizer():
    """The real default model's tokenizer (SmolLM2-135M-Instruct), converted from its GGUF once per cache."""
    from transformers import AutoTokenizer

    from keydiff.models import ensure_builtin_model

    return AutoTokenizer.from_pretrained(str(ensure_builtin_model("smollm2-135m")), local_files_only=True)


@pytest.fixture(scope="session")
def model():
    return tiny_llama()


@pytest.fixture(scope="session")
def device_model(device):
    """The `model` fixture's tiny Llama on the `device` tests' device (a copy of its own: `model` stays on CPU)."""
    return tiny_llama().to(device)


def out_of_memory_error() -> BaseException:
    """What CUDA raises when memory runs out (the error every back-off and failed row reads)."""
    import torch

    return torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


@dataclass
class Injected:
    """What an `inject_oom` injector did: the calls it saw and the errors it raised."""

    calls: int = 0
    raised: int = 0


@pytest.fixture
def inject_oom(monkeypatch):
    """Out of memory raised inside a decoder's work through its documented seams, one fixture for every test:
    `inject_oom(when)` wraps keydiff.decode.scheduler.decode_step (`when(active)`, the step's sequences);
    at="prefill" wraps keydiff.run.batched.prefill_sample (`when(prompt)`). after=True raises after the real call
    (memory running out once the step ran), else instead of it; `times` raises at most (None: every time `when`
    holds); `error` makes the error (default: CUDA's out of memory). Returns the `Injected` counts."""
    def inject(when, at: str = "step", after: bool = False, times: int | None = 1,
               error=out_of_memory_error) -> Injected:
        if at == "step":
            from keydiff.decode import scheduler as owner
            name = "decode_step"
        elif at == "prefill":
            from keydiff.run import batched as owner
            name = "prefill_sample"
        else:
            raise ValueError(f"at={at!r} is not valid; valid: 'step', 'prefill'")
        real, injected = getattr(owner, name), Injected()

        def injecting(*args):
            injected.calls += 1
            result = real(*args) if after else None
            if (times is None or injected.raised < times) and when(args[-1]):
                injected.raised += 1
                raise error()
            return result if after else real(*args)

        monkeypatch.setattr(owner, name, injecting)
        return injected

    return inject


@pytest.fixture(scope="session")
def prompt():
    import torch

    generator = torch.Generator().manual_seed(1)
    return torch.randint(0, 256, (1, 300), generator=generator)


@dataclass
class LengthsTask(Task):
    """A runner task with prompts of chosen token lengths (char tokenizer: BOS + one token per character).

    Build it through Hydra with `_target_: tests.conftest.LengthsTask`. Every sample decodes exactly
    `max_new_tokens` tokens (stop tokens are masked until then), so cache sizes can be computed by hand.
    """

    name: str = "guard_lengths"
    lengths: list[int] = field(default_factory=lambda: [30, 100])
    max_new_tokens: int = 4
    limit: int | None = None

    def samples(self) -> Iterator[Sample]:
        for length in self.lengths[: self.limit]:
            yield Sample(id=f"len{length}", fields={"length": int(length)})

    def build_prompt(self, sample: Sample, tokenizer: Any, max_length: int | None) -> Prompt:
        length = sample.fields["length"]
        text = "".join(chr(33 + (7 * i + length) % 90) for i in range(length - 1))
        ids = list(tokenizer(text)["input_ids"])
        assert len(ids) == length, (len(ids), length)
        settings = GenerationSettings(max_new_tokens=self.max_new_tokens, min_new_tokens=self.max_new_tokens)
        return Prompt(ids, settings, {"length": length})

    def score(self, sample: Sample, prediction: str) -> dict[str, float]:
        return {"chars": float(len(prediction))}
