"""An FP8 block-scaled DeepSeek-V3 checkpoint (MLA + MoE, with its MTP layer), quantized by our own
writer as DeepSeek's FP8 release is laid out: every projection of the target and of the MTP layer,
routed and shared experts included, in float8 e4m3 with 16 x 16 block scales; `eh_proj`, the router,
norms, embedding and LM head in full precision. The engine must produce exactly what it produces on
the dequantized reference checkpoint (the same numbers), with and without MTP, at PP 1 and 2."""
from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file, save_file

from pipespec import LLM, SamplingParams
from tests.model.deepseek import tiny
from tests.model.quant import writers

BLOCK = (16, 16)
KW = dict(dtype="float32", device="cpu", max_model_len=128, block_size=16, num_kv_blocks=64, max_num_seqs=8,
          max_num_batched_tokens=24)
PROMPTS = [{"prompt_token_ids": ids} for ids in ([5, 77, 300, 41, 9], [12], list(range(20, 44)))]


def _quantized(name: str) -> bool:
    return name.endswith("_proj.weight") and ".layers." in name and not name.endswith("eh_proj.weight")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tokenizer):
    """(fp8 folder, dequantized reference folder) of the same DeepSeek-V3 + MTP checkpoint."""
    root = tmp_path_factory.mktemp("deepseek-fp8")
    ref = tiny.write_with_mtp(root / "reference", "lora_yarn", seed=31, tokenizer=tokenizer)
    fp8 = tiny.write_with_mtp(root / "fp8", "lora_yarn", seed=31, tokenizer=tokenizer)
    tensors = load_file(str(ref / "model.safetensors"))
    quantized, dequantized = {}, dict(tensors)
    for name, w in tensors.items():
        if _quantized(name):
            parts, dequantized[name] = writers.fp8(w, BLOCK)
            prefix = name.removesuffix(".weight")
            quantized.update({f"{prefix}.{k}": v for k, v in parts.items()})
        else:
            quantized[name] = w
    assert sum(n.endswith("weight_scale_inv") for n in quantized) > 50       # experts of both layers
    save_file(dequantized, str(ref / "model.safetensors"))
    save_file(quantized, str(fp8 / "model.safetensors"))
    cfg = json.loads((fp8 / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": list(BLOCK)}
    (fp8 / "config.json").write_text(json.dumps(cfg))
    return str(fp8), str(ref)


def _greedy(folder: str, **kw) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    with LLM(model=folder, **KW, **kw) as llm:
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def test_fp8_moe_target_with_mtp_equals_its_dequantized_reference(checkpoints):
    fp8, ref = checkpoints
    want = _greedy(ref)
    assert _greedy(fp8) == want
    spec = {"method": "mtp", "num_speculative_tokens": 2}      # the checkpoint's own MTP layer, fp8 too
    assert _greedy(fp8, pipeline_parallel_size=2, threads_per_stage=1, speculative_config=spec) == want


def test_a_float8_tensor_without_its_scales_is_refused(checkpoints, tmp_path):
    import shutil
    fp8, _ = checkpoints
    folder = tmp_path / "broken"
    shutil.copytree(fp8, folder)
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["model.layers.1.mlp.experts.5.up_proj.weight_scale_inv"]
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(Exception, match=r"model\.layers\.1\.mlp\.experts\.5\.up_proj\.weight is torch\.float8_e4m3fn, "
                                        r"not a plain float weight"):
        _greedy(str(folder))
