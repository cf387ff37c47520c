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
    from pipespec.checkpoint.source import resolve_model
    from pipespec.stage import Stage
    folder = _config_only_folder(tmp_path, tokenizer)
    source = resolve_model(str(folder))
    config = EngineConfig.from_kwargs(model=str(folder), load_format="dummy", device="cpu", num_kv_blocks=4)
    whole = Stage(source, config, (0, 3), 64).model.state_dict()
    parts = {**Stage(source, config, (0, 1), 64).model.state_dict(), **Stage(source, config, (1, 3), 64).model.state_dict()}
    assert whole.keys() == parts.keys()
    assert all(torch.equal(whole[name], parts[name]) for name in whole)


def test_a_tied_head_on_a_later_stage_draws_the_embedding(tmp_path, tokenizer):
    """A tied model split at PP = 2: the last stage's own head copy holds stage 0's embedding values."""
    from pipespec.config import EngineConfig
    from pipespec.checkpoint.source import resolve_model
    from pipespec.stage import Stage
    from tests.conftest import _tiny_config, write_tokenizer_files
    cfg = _tiny_config("llama")
    cfg.tie_word_embeddings = True
    cfg.save_pretrained(tmp_path)
    write_tokenizer_files(tmp_path, tokenizer)
    source = resolve_model(str(tmp_path))
    config = EngineConfig.from_kwargs(model=str(tmp_path), load_format="dummy", device="cpu", num_kv_blocks=4)
    first, last = Stage(source, config, (0, 1), 64).model, Stage(source, config, (1, 3), 64).model
    assert last.owns_head and torch.equal(last.head_weight(), first.model.embed_tokens.weight)


def _greedy(folder, **kw):
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    with LLM(model=str(folder), load_format="dummy", device="cpu", num_kv_blocks=32, max_model_len=64, **kw) as llm:
        out = llm.generate([{"prompt_token_ids": [5, 6, 7, 8, 9]}], params, use_tqdm=False)[0].outputs[0].token_ids
        return out, llm.stats().get("spec_decode")


def test_dummy_mtp_layers_of_the_families_that_ship_them(tmp_path, tokenizer):
    """A config-only folder that declares MTP layers drafts with random layers of its family (the
    benchmarks' MTP step cost), losslessly at PP = 1 and 2; a family that ships none is refused."""
    import pytest

    from tests.conftest import write_tokenizer_files
    from tests.model import hybrid_tiny as ht
    from tests.model.deepseek import tiny as ds
    folders = {}
    for name, hf in (("qwen3_5_moe", ht.hf_model("qwen3_5_moe").config), ("deepseek_v3", ds.hf_config("lora_yarn"))):
        folder = tmp_path / name
        hf.save_pretrained(folder)
        cfg = json.loads((folder / "config.json").read_text())
        (cfg.get("text_config") or cfg)["mtp_num_hidden_layers" if "text_config" in cfg else "num_nextn_predict_layers"] = 1
        (folder / "config.json").write_text(json.dumps(cfg))
        write_tokenizer_files(folder, tokenizer)
        folders[name] = folder
    for folder in folders.values():
        want, _ = _greedy(folder)
        for pp in (1, 2):
            got, stats = _greedy(folder, pipeline_parallel_size=pp,
                                 speculative_config={"method": "mtp", "num_speculative_tokens": 2})
            assert got == want and stats["num_drafts"] > 0
    llama = _config_only_folder(tmp_path / "llama", tokenizer)
    spec = {"method": "mtp", "num_speculative_tokens": 1}
    with pytest.raises(ValueError, match="declares no MTP layers"):
        _greedy(llama, speculative_config=spec)
    cfg = json.loads((llama / "config.json").read_text())
    (llama / "config.json").write_text(json.dumps(dict(cfg, num_nextn_predict_layers=1)))
    with pytest.raises(ValueError, match="llama ships none"):
        _greedy(llama, speculative_config=spec)


_PEAK_SCRIPT = """
import sys
from pathlib import Path
from pipespec import LLM

def status(key):      # kB; VmHWM, not getrusage: a child's ru_maxrss starts at its parent's at the fork
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(key))
    return int(line.split()[1]) * 1024

Path("/proc/self/clear_refs").write_text("5")         # start the high-water mark from here
before = status("VmRSS")
llm = LLM(model=sys.argv[1], load_format="dummy", device="cpu", dtype="bfloat16", num_kv_blocks=4, max_model_len=64)
weights = sum(p.numel() * p.element_size() for p in llm.engine.executor.stage.model.parameters())
print(weights, status("VmHWM") - before)
"""


def test_loading_holds_the_weights_once(tmp_path, tokenizer):
    """Parameters are allocated where they live, in their dtype, as they load: building a model's
    float32 parameters first, then moving and converting them, peaked at twice a bf16 model's
    weights (a 60 GB model failed to load on an 80 GB GPU). Now ~1.4x: the rest is the engine's
    own (KV cache, tables, tokenizer)."""
    import subprocess
    import sys

    from transformers import LlamaConfig

    from tests.conftest import write_tokenizer_files
    LlamaConfig(vocab_size=49152, hidden_size=1024, intermediate_size=4096, num_hidden_layers=8,
                num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=256,
                tie_word_embeddings=False).save_pretrained(tmp_path)
    write_tokenizer_files(tmp_path, tokenizer)
    out = subprocess.run([sys.executable, "-c", _PEAK_SCRIPT, str(tmp_path)], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    weights, grown = map(int, out.stdout.split()[-2:])
    assert weights > 400e6                           # ~0.5 GB of bf16 weights: big next to the interpreter
    assert grown < 1.6 * weights, f"loading grew the process by {grown / 1e6:.0f} MB for {weights / 1e6:.0f} MB"
