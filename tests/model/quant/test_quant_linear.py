"""Quantized checkpoints served by the weight-only kernels (`model/quant/linear.py`): the linear
layers whose checkpoint tensors are all quantized become `QuantLinear`s holding the packed weight
(fused q/k/v and gate/up from their parts), the rest loads dense, and the engine's logits and greedy
output equal transformers on the dequantized reference weights. The swap itself is checked on CPU
(its dense fallback); the engine runs the kernels on a GPU, or on CPU under TRITON_INTERPRET=1."""
from __future__ import annotations


import pytest
import torch

from pipespec import LLM, SamplingParams
from pipespec.model.quant.linear import QuantLinear, use_quantized_linears
from pipespec.model.registry import build_target
from pipespec.checkpoint.source import resolve_model
from tests.helpers import INTERPRET, engine_logits, hf_logits
from tests.model.quant.test_quantized_checkpoints import LAYOUTS, PROMPT, _write

KERNELS = torch.cuda.is_available() or INTERPRET        # where the quantized kernels run
FUSED = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_quantized_linears_replace_every_fused_projection(layout, tiny_models, tmp_path):
    folder, _ = _write(tmp_path / layout, tiny_models["llama"], layout)
    source = resolve_model(str(folder))
    model = build_target(source.arch, (0, source.arch.num_layers), 64)
    dense = {name: [p for p in parts] for name, parts in model.checkpoint_names().items()}
    weights = source.weights()
    count = use_quantized_linears(model, weights, torch.device("cpu"))
    assert count == len(FUSED) * source.arch.num_layers
    names = model.checkpoint_names()
    for i in range(source.arch.num_layers):
        for proj in FUSED:
            name = f"model.layers.{i}.{proj}"
            module = model.get_submodule(name)
            assert isinstance(module, QuantLinear)
            assert f"{name}.weight" not in names           # never asked of the dense loader
            # outside inference mode the dense fallback: the dequantized parts, concatenated
            want = torch.cat([weights.get(p) for p in dense[f"{name}.weight"]])
            x = torch.randn(3, module.in_features)
            torch.testing.assert_close(module(x), x @ want.t(), rtol=1e-5, atol=1e-5)
    assert not isinstance(model.lm_head, QuantLinear)


@pytest.mark.gpu(interpret=True)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_engine_on_the_kernels_matches_the_dequantized_reference(layout, tiny_models, tmp_path):
    folder, ref = _write(tmp_path / layout, tiny_models["llama"], layout)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with LLM(model=str(folder), device=device, dtype="float32", num_kv_blocks=32, max_model_len=128,
             enforce_eager=True, gpu_memory_utilization=0.2) as llm:
        model = llm.engine.executor.stage.model
        assert sum(isinstance(m, QuantLinear) for m in model.modules()) == len(FUSED) * 3
        got = engine_logits(llm, PROMPT).cpu()
        out = llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(temperature=0.0, max_tokens=8,
                           ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids
    torch.testing.assert_close(got, hf_logits(ref, PROMPT), rtol=1e-4, atol=1e-4)
    want = ref.generate(torch.tensor([PROMPT]), max_new_tokens=8, do_sample=False, min_new_tokens=8)[0, len(PROMPT):]
    assert out == want.tolist()


@pytest.mark.parametrize("method", ["fp8", "awq"])
def test_dummy_quantized_linears_draw_weights_like_the_dense_dummy(method, tiny_models):
    from pipespec.model.quant.linear import use_dummy_quantized_linears
    source = resolve_model(str(tiny_models["llama"][0]))
    model = build_target(source.arch, (0, source.arch.num_layers), 64)
    assert use_dummy_quantized_linears(model, method, torch.device("cpu")) == len(FUSED) * source.arch.num_layers
    module = model.get_submodule("model.layers.0.mlp.down_proj")
    assert isinstance(module, QuantLinear) and module.packed.shape == (64, 96)
    w = module.packed.dequantize()
    assert 0.01 < w.std().item() < 0.04 and w.mean().abs().item() < 0.01


def test_quantization_must_name_the_checkpoints_own(tiny_models, tmp_path):
    plain = str(tiny_models["llama"][0])
    with pytest.raises(ValueError, match="quantization='awq', but .* is not quantized"):
        LLM(model=plain, quantization="awq", device="cpu", num_kv_blocks=8)
    folder, _ = _write(tmp_path / "awq", tiny_models["llama"], "awq")
    with pytest.raises(ValueError, match="quantization='fp8', but .* is quantized with 'awq'"):
        LLM(model=str(folder), quantization="fp8", device="cpu", num_kv_blocks=8)
    with pytest.raises(ValueError, match="quantization must be one of"):
        LLM(model=plain, quantization="int3", device="cpu", num_kv_blocks=8)


@pytest.mark.skipif(KERNELS, reason="checks the refusal where the quantized kernels cannot run")
def test_dummy_quantization_without_the_kernels_is_refused(tiny_models):
    with pytest.raises(ValueError, match="quantization='fp8' with dummy weights runs on the quantized kernels"):
        LLM(model=str(tiny_models["llama"][0]), load_format="dummy", quantization="fp8", device="cpu",
            num_kv_blocks=8)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("rank", [0, 1])
def test_tensor_parallel_shards_of_the_packed_weights_equal_the_dense_shards(layout, rank, tiny_models, tmp_path):
    """At TP = 2 each rank's packed shard (output rows of a column-parallel layer, input columns of a
    row-parallel one) dequantizes to exactly the dense shard the loader gives that rank; layers that
    cannot be cut on the layout's boundaries (act-order rows, FP8 blocks across a shard) stay dense."""
    from pipespec.model.weights import load_weights
    from pipespec.parallel import TensorParallel
    folder, _ = _write(tmp_path / layout, tiny_models["llama"], layout)
    source = resolve_model(str(folder))
    layers = (0, source.arch.num_layers)
    dense = build_target(source.arch, layers, 64, TensorParallel(rank, 2))
    load_weights(dense, source.weights(), torch.float32, torch.device("cpu"))
    model = build_target(source.arch, layers, 64, TensorParallel(rank, 2))
    count = use_quantized_linears(model, source.weights(), torch.device("cpu"))
    swapped = {name: m for name, m in model.named_modules() if isinstance(m, QuantLinear)}
    assert len(swapped) == count > 0
    for name, module in swapped.items():
        torch.testing.assert_close(module.packed.dequantize(), dense.get_submodule(name).weight, rtol=0, atol=1e-6)
        assert (module.tp is not None) == name.endswith(("o_proj", "down_proj"))
    if layout == "gptq-act-order":
        assert not any(name.endswith(("o_proj", "down_proj")) for name in swapped)


@pytest.mark.gpu(devices=2, interpret=True)
def test_engine_on_the_kernels_at_tp2_equals_tp1(tiny_models, tmp_path):
    """AWQ, split over two ranks on the kernels (row-parallel layers all-reduce their partial sums):
    greedy output equals one rank's."""
    folder, _ = _write(tmp_path / "awq", tiny_models["llama"], "awq")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    kw = dict(device=device, dtype="float32", num_kv_blocks=32, max_model_len=128, enforce_eager=True,
              gpu_memory_utilization=0.2)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    with LLM(model=str(folder), **kw) as llm:
        want = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)[0].outputs[0].token_ids
    with LLM(model=str(folder), tensor_parallel_size=2, **kw) as llm:
        swapped = {n.rsplit(".", 1)[-1] for n, m in llm.engine.executor.stage.model.named_modules()
                   if isinstance(m, QuantLinear)}
        # down_proj's 48 input columns a rank are not whole groups of 32: it stays dense
        assert swapped == {"qkv_proj", "o_proj", "gate_up_proj"}
        got = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)[0].outputs[0].token_ids
    assert got == want
