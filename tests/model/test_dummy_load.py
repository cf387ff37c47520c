"""load_format="dummy": random weights of the checkpoint's shapes, nothing read (for benchmarks)."""
import json

import torch

from pipespec import LLM, SamplingParams


def _config_only_folder(tmp_path, tokenizer):
    from tests.conftest import _tiny_config, write_tokenizer_files
    _tiny_config("llama").save_pretrained(tmp_path)
    write_tokenizer_files(tmp_path, tokenizer)
    return tmp_path


def test_dummy_weights_need_no_weight_files(tmp_path, tokenizer):
    folder = _config_only_folder(tmp_path, tokenizer)
    assert not list(folder.glob("*.safetensors"))
    with LLM(model=str(folder), load_format="dummy", device="cpu", num_kv_blocks=16, max_model_len=64) as llm:
        model = llm.engine.executor.stage.model
        norm = model.model.norm.weight
        proj = model.model.layers["0"].self_attn.qkv_proj.weight
        assert torch.equal(norm, torch.ones_like(norm))
        assert 0.015 < proj.float().std().item() < 0.025
        out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
                           use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 6


def test_missing_weights_without_dummy_is_a_clear_error(tmp_path, tokenizer):
    import pytest
    folder = _config_only_folder(tmp_path, tokenizer)
    with pytest.raises(Exception, match=r"(?i)safetensors|weights"):
        LLM(model=str(folder), device="cpu", num_kv_blocks=16, max_model_len=64)
    assert json.loads((folder / "config.json").read_text())["model_type"] == "llama"


def test_dummy_weights_are_the_same_at_every_pipeline_split(tmp_path, tokenizer):
    """Keyed by tensor name, so PP = 2's stages hold exactly PP = 1's layers (benchmarks compare them)."""
    from pipespec.config import EngineConfig
    from pipespec.model.source import resolve_model
    from pipespec.stage import Stage
    folder = _config_only_folder(tmp_path, tokenizer)
    source = resolve_model(str(folder))
    config = EngineConfig.from_kwargs(model=str(folder), load_format="dummy", device="cpu", num_kv_blocks=4)
    whole = Stage(source, config, (0, 3), 64).model.state_dict()
    parts = {**Stage(source, config, (0, 1), 64).model.state_dict(), **Stage(source, config, (1, 3), 64).model.state_dict()}
    assert whole.keys() == parts.keys()
    assert all(torch.equal(whole[name], parts[name]) for name in whole)
