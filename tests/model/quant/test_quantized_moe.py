"""An FP8 block-scaled DeepSeek-V3 checkpoint (MLA + MoE, with its MTP layer), quantized by our own
writer as DeepSeek's FP8 release is laid out: every projection of the target and of the MTP layer,
routed and shared experts included, in float8 e4m3 with 16 x 16 block scales; `eh_proj`, the router,
norms, embedding and LM head in full precision. The engine must produce exactly what it produces on
the dequantized reference checkpoint (the same numbers), with and without MTP, at PP 1 and 2.

Where the kernels serve (a GPU, or CPU under TRITON_INTERPRET=1) the routed experts stay quantized
(`model/quant/experts.py`), FP8 when each expert's rows are whole scale blocks (a checkpoint with
32-row experts here; the other's 24-row experts load dense), and AWQ int4 likewise: the swap is
checked on CPU, the engine on the kernels."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from pipespec import LLM, SamplingParams
from pipespec.model.quant.experts import Fp8Stack, Int4Stack, use_quantized_experts
from pipespec.model.quant.linear import QuantLinear
from pipespec.model.registry import build_target
from pipespec.model.routed_experts import routed_experts
from pipespec.checkpoint.source import resolve_model
from tests.model.deepseek import tiny
from tests.model.quant import writers


BLOCK = (16, 16)
KW = dict(dtype="float32", device="cpu", max_model_len=128, block_size=16, num_kv_blocks=64, max_num_seqs=8,
          max_num_batched_tokens=24)
PROMPTS = [{"prompt_token_ids": ids} for ids in ([5, 77, 300, 41, 9], [12], list(range(20, 44)))]
ON_KERNELS = dict(device="cuda" if torch.cuda.is_available() else "cpu", enforce_eager=True)


def _quantized(name: str) -> bool:
    return (name.endswith(("_proj.weight", "_proj_with_mqa.weight")) and ".layers." in name
            and not name.endswith("eh_proj.weight"))


# AWQ: groups of 16 input rows, layers whose input is not a whole number of groups kept in full
# precision (the tiny q LoRA of 24)
METHODS = {"fp8": ({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                    "weight_block_size": list(BLOCK)}, lambda w: writers.fp8(w, BLOCK), "weight_scale_inv"),
           "awq": ({"quant_method": "awq", "bits": 4, "group_size": 16, "zero_point": True, "version": "gemm"},
                   lambda w: writers.awq(w, 16) if w.shape[1] % 16 == 0 else None, "qweight")}


def _write(root, tokenizer, method="fp8", **overrides):
    """(quantized folder, dequantized reference folder) of the same DeepSeek-V3 + MTP checkpoint."""
    qcfg, quantize, marker = METHODS[method]
    ref = tiny.write_with_mtp(root / "reference", "lora_yarn", seed=31, tokenizer=tokenizer, **overrides)
    folder = tiny.write_with_mtp(root / method, "lora_yarn", seed=31, tokenizer=tokenizer, **overrides)
    tensors = load_file(str(ref / "model.safetensors"))
    quantized, dequantized = {}, dict(tensors)
    for name, w in tensors.items():
        done = quantize(w) if _quantized(name) else None
        if done is None:
            quantized[name] = w
            continue
        parts, dequantized[name] = done
        prefix = name.removesuffix(".weight")
        quantized.update({f"{prefix}.{k}": v for k, v in parts.items()})
    assert sum(n.endswith(marker) for n in quantized) > 50       # experts of both layers
    save_file(dequantized, str(ref / "model.safetensors"))
    save_file(quantized, str(folder / "model.safetensors"))
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = qcfg
    (folder / "config.json").write_text(json.dumps(cfg))
    return str(folder), str(ref)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tokenizer):
    return _write(tmp_path_factory.mktemp("deepseek-fp8"), tokenizer)


@pytest.fixture(scope="module", params=list(METHODS))
def experts_quantized(request, tmp_path_factory, tokenizer):
    """(method, folder, reference) with experts of 32 rows and a q LoRA of 32: whole 16-row FP8 scale
    blocks, as real ones (2,048 / 1,536 rows, 128-row blocks) are, and whole AWQ groups."""
    folder = tmp_path_factory.mktemp(f"deepseek-{request.param}-experts")
    return (request.param, *_write(folder, tokenizer, request.param, moe_intermediate_size=32, q_lora_rank=32))


def _engine(folder: str, **kw) -> LLM:
    return LLM(model=folder, **{**KW, **kw})


def _outputs(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def _greedy(folder: str, **kw) -> list[list[int]]:
    with _engine(folder, **kw) as llm:
        return _outputs(llm)


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


def test_quantized_experts_stay_quantized_and_multiply_like_their_dequantized_stacks(experts_quantized):
    """Each MoE layer's two expert stacks become `Fp8Stack`s or `Int4Stack`s (never asked of the
    dense loader); on CPU (no kernels) they multiply by dequantizing each picked expert, equal to the
    dense stacks of the dequantized reference, other ranks' experts adding nothing."""
    method, folder, ref = experts_quantized
    source = resolve_model(folder)
    model = build_target(source.arch, (0, source.arch.num_layers), 64)
    assert use_quantized_experts(model, source.weights(), torch.device("cpu")) == 2 * 2    # 2 MoE layers
    names = model.checkpoint_names()
    dense = build_target(source.arch, (0, source.arch.num_layers), 64)
    from pipespec.model.weights import load_weights
    load_weights(dense, resolve_model(ref).weights(), torch.float32, "cpu")
    gen = torch.Generator().manual_seed(0)
    kind = Fp8Stack if method == "fp8" else Int4Stack
    for i in (1, 2):
        moe, want = model.model.layers[str(i)].mlp, dense.model.layers[str(i)].mlp
        assert isinstance(moe.experts_gate_up, kind) and isinstance(moe.experts_down, kind)
        assert not any(n.startswith(f"model.layers.{i}.mlp.experts_") for n in names)
        x = torch.randn(5, 64, generator=gen)
        ids = torch.randint(0, 8, (5, 3), generator=gen)
        w = torch.rand(5, 3, generator=gen)
        up, down = want.experts_gate_up.view(8, -1, 64), want.experts_down.view(8, 64, -1)
        torch.testing.assert_close(routed_experts(x, ids, w, moe.experts_gate_up, moe.experts_down),
                                   routed_experts(x, ids, w, up, down), rtol=1e-5, atol=1e-5)
        # a rank whose experts start at global id 8: pairs of experts below add nothing
        torch.testing.assert_close(routed_experts(x, ids + 4, w, moe.experts_gate_up, moe.experts_down, first=8),
                                   routed_experts(x, ids + 4, w, up, down, first=8), rtol=1e-5, atol=1e-5)


@pytest.mark.gpu(interpret=True)
def test_engine_on_quantized_experts_equals_its_dequantized_reference(experts_quantized):
    method, folder, ref = experts_quantized
    want = _greedy(ref, **ON_KERNELS)
    with _engine(folder, **ON_KERNELS) as llm:
        model = llm.engine.executor.stage.model
        assert sum(isinstance(m, (Fp8Stack, Int4Stack)) for m in model.modules()) == 4
        attn = model.model.layers["0"].self_attn            # MLA's latent projections stay quantized too,
        assert isinstance(attn.fused_qkv_a_proj, QuantLinear)   # fused (q_a's rows: whole scale blocks)
        assert isinstance(attn.q_b_proj, QuantLinear)
        assert _outputs(llm) == want
    spec = {"method": "mtp", "num_speculative_tokens": 2}      # the checkpoint's MTP layer: quantized alike
    with _engine(folder, speculative_config=spec, **ON_KERNELS) as llm:
        drafter = llm.engine.executor.stage.drafter
        assert sum(isinstance(m, (Fp8Stack, Int4Stack)) for m in drafter.modules()) == 2
        assert any(isinstance(m, QuantLinear) for m in drafter.modules())
        assert _outputs(llm) == want


@pytest.mark.gpu(interpret=True)
def test_engine_on_quantized_experts_at_tp2_equals_its_dequantized_reference(experts_quantized):
    """Each rank keeps its 4 of the 8 experts quantized (pairs routed to the other rank's add nothing
    on this one; the all-reduce sums the two): greedy output equals the dequantized reference's."""
    method, folder, ref = experts_quantized
    want = _greedy(ref, **ON_KERNELS)
    # gloo: the two ranks may share one GPU (the TP collectives then run on the host)
    with _engine(folder, tensor_parallel_size=2, distributed_backend="gloo", **ON_KERNELS) as llm:
        stacks = [m for m in llm.engine.executor.stage.model.modules() if isinstance(m, (Fp8Stack, Int4Stack))]
        assert len(stacks) == 4 and all(m.experts == 4 for m in stacks)
        assert _outputs(llm) == want


def test_dummy_fp8_experts_draw_weights_like_the_dense_dummy(experts_quantized):
    """`--load-format dummy --quantization fp8` (benchmarks at real shapes): random FP8 stacks of the
    dense stacks' shapes, weights about N(0, 0.02) once dequantized."""
    from pipespec.model.quant.experts import use_dummy_quantized_experts
    source = resolve_model(experts_quantized[1])
    model = build_target(source.arch, (0, source.arch.num_layers), 64)
    shapes = {i: model.model.layers[str(i)].mlp.experts_down.shape for i in (1, 2)}
    assert use_dummy_quantized_experts(model, torch.device("cpu")) == 4
    for i in (1, 2):
        down = model.model.layers[str(i)].mlp.experts_down
        assert isinstance(down, Fp8Stack) and tuple(down.weight.shape) == tuple(shapes[i])
        assert down.weight.dtype == torch.float8_e4m3fn
        assert 0.015 < down.expert(3).std().item() < 0.025


def test_experts_that_are_not_whole_scale_blocks_stay_dense_both_stacks(checkpoints):
    """24-row experts with 16-row FP8 blocks: gate/up cannot be stacked, so neither stack is (the
    down stack alone would meet a dense gate/up in one product)."""
    source = resolve_model(checkpoints[0])
    model = build_target(source.arch, (0, source.arch.num_layers), 64)
    assert use_quantized_experts(model, source.weights(), torch.device("cpu")) == 0
    moe = model.model.layers["1"].mlp
    assert isinstance(moe.experts_gate_up, torch.nn.Parameter) and isinstance(moe.experts_down, torch.nn.Parameter)
