"""Quantized checkpoints (FP8 block-scaled, AWQ, GPTQ with and without act-order) written by our own
writers from the tiny Llama: the engine's logits equal transformers' on the dequantized reference
weights (the same numbers, so to float tolerance: the quantization error itself, up to ~0.2 per
weight here, is not in the comparison), greedy output is identical, and MTP stays lossless at PP = 2.
Checkpoints the engine does not understand are refused by name."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import save_file

from pipespec import LLM, SamplingParams
from pipespec.model.quant.formats import dequant_awq, dequant_fp8, dequant_gptq
from tests.helpers import hf_logits
from tests.model.quant import writers

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")
LAYOUTS = {
    "fp8": ({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [32, 48]},
            lambda w: writers.fp8(w, (32, 48))),
    "awq": ({"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm",
             "modules_to_not_convert": ["lm_head"]}, lambda w: writers.awq(w, 32)),
    "gptq": ({"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": True},
             lambda w: writers.gptq(w, 32, act_order=False)),
    "gptq-act-order": ({"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True, "sym": True},
                       lambda w: writers.gptq(w, 32, act_order=True)),
}
PROMPT = [5, 300, 7001, 42, 9, 1200, 77]
KW = dict(device="cpu", dtype="float32", num_kv_blocks=32, max_model_len=128)


def _write(folder, tiny, layout):
    """A copy of the tiny llama in `layout`; returns (folder, the transformers model on its reference
    weights)."""
    src, model = tiny
    qcfg, quantize = LAYOUTS[layout]
    shutil.copytree(src, folder, ignore=shutil.ignore_patterns("*.safetensors*"))
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    reference = dict(state)
    for name in list(state):
        prefix = name.removesuffix(".weight")
        if name.endswith(".weight") and prefix.split(".", 3)[-1] in LINEARS:
            parts, ref = quantize(state.pop(name))
            state.update({f"{prefix}.{k}": v for k, v in parts.items()})
            reference[name] = ref
    save_file(state, str(folder / "model.safetensors"))
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = qcfg
    (folder / "config.json").write_text(json.dumps(cfg))
    ref_model = type(model)(model.config).eval()
    ref_model.load_state_dict(reference)
    return folder, ref_model


@pytest.fixture(scope="module", params=list(LAYOUTS))
def quantized(request, tiny_models, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param) / "model"
    return (request.param, *_write(folder, tiny_models["llama"], request.param))


def test_logits_and_greedy_match_the_dequantized_reference(quantized):
    layout, folder, ref = quantized
    with LLM(model=str(folder), **KW) as llm:
        from tests.helpers import engine_logits
        got = engine_logits(llm, PROMPT)
        out = llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                           use_tqdm=False)[0].outputs[0].token_ids
    torch.testing.assert_close(got, hf_logits(ref, PROMPT), rtol=1e-4, atol=1e-4)
    want = ref.generate(torch.tensor([PROMPT]), max_new_tokens=8, do_sample=False, min_new_tokens=8)[0, len(PROMPT):]
    assert out == want.tolist(), layout


def test_mtp_is_lossless_at_pp2_on_a_quantized_checkpoint(tmp_path, tiny_models, tiny_llama_head):
    """One layout (the loader is shared): GPTQ with act-order, split over two stage processes."""
    folder, _ = _write(tmp_path / "gptq", tiny_models["llama"], "gptq-act-order")
    head = str(tiny_llama_head[1])
    prompts = [{"prompt_token_ids": PROMPT}, {"prompt_token_ids": PROMPT[:3]}]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    with LLM(model=str(folder), **KW) as llm:
        want = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    with LLM(model=str(folder), pipeline_parallel_size=2, threads_per_stage=1,
             speculative_config={"method": "mtp", "num_speculative_tokens": 2, "model": head}, **KW) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want


def test_readers_agree_with_the_writers_integers():
    w = torch.randn(96, 64, generator=torch.Generator().manual_seed(3))
    t, ref = writers.fp8(w, (128, 128))                                   # one partial block
    assert torch.equal(dequant_fp8(t["weight"], t["weight_scale_inv"], (128, 128)), ref)
    t, ref = writers.awq(w, 32)
    assert torch.equal(dequant_awq(t["qweight"], t["qzeros"], t["scales"], 32), ref)
    t, ref = writers.gptq(w, 16, act_order=True)
    assert torch.equal(dequant_gptq(t["qweight"], t["qzeros"], t["scales"], t["g_idx"]), ref)
    assert (ref - w).abs().max() < 0.35                                   # 4-bit: error within a step


def _with_config(tmp_path, tiny, qcfg):
    folder = tmp_path / "m"
    shutil.copytree(tiny[0], folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = qcfg
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def test_an_unsupported_method_is_refused_by_name(tmp_path, tiny_models):
    folder = _with_config(tmp_path, tiny_models["llama"], {"quant_method": "bitsandbytes", "load_in_4bit": True})
    with pytest.raises(ValueError, match=r"quantized with 'bitsandbytes'.*pipespec reads fp8 .*awq .*gptq"):
        LLM(model=str(folder), **KW)


def test_quantized_tensors_without_a_quantization_config_are_refused(tmp_path, tiny_models):
    folder, _ = _write(tmp_path / "fp8", tiny_models["llama"], "fp8")
    cfg = json.loads((folder / "config.json").read_text())
    del cfg["quantization_config"]                                        # the new user's garbage case
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"holds quantization tensors .*weight_scale_inv.* no quantization_config"):
        LLM(model=str(folder), **KW)


def test_a_layer_missing_part_of_its_layout_is_named(tmp_path, tiny_models):
    folder, _ = _write(tmp_path / "awq", tiny_models["llama"], "awq")
    from safetensors.torch import load_file
    state = load_file(str(folder / "model.safetensors"))
    del state["model.layers.1.mlp.up_proj.qzeros"]
    save_file(state, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj lacks model\.layers\.1\.mlp\.up_proj\.qzeros"):
        LLM(model=str(folder), **KW)
