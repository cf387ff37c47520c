"""Fused elementwise kernels against the PyTorch ops they replace (GPU only)."""
import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rms_norm_with_and_without_residual(dtype):
    from pipespec.kernels.fused_ops import rms_norm
    from pipespec.model.layers import RMSNorm
    x = torch.randn(37, 576, device="cuda", dtype=dtype)
    res = torch.randn_like(x)
    norm = RMSNorm(576, 1e-5).cuda().to(dtype)
    norm.weight.data.normal_(1.0, 0.2)
    want, want_res = norm(x, res)           # grad mode: the PyTorch path
    got, got_res = rms_norm(x, norm.weight, 1e-5, res)
    assert torch.equal(got_res, want_res)
    assert _rel(got, want) < (1e-2 if dtype == torch.bfloat16 else 1e-6)
    assert _rel(rms_norm(x, norm.weight, 1e-5), norm(x)) < (1e-2 if dtype == torch.bfloat16 else 1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_zero_centred_rms_norm(dtype):
    """Qwen3.5's (1 + w) norm: one kernel, with and without a residual, also on a strided view of
    per-head rows (the gated attention's q)."""
    from pipespec.kernels.fused_ops import rms_norm
    from pipespec.model.norms import ZeroCentredRMSNorm
    x = torch.randn(7, 6, 2 * 128, device="cuda", dtype=dtype)[..., :128]
    res = torch.randn_like(x)
    norm = ZeroCentredRMSNorm(128, 1e-6).cuda().to(dtype)
    norm.weight.data.normal_(0.0, 0.2)
    want, want_res = norm(x, res)           # grad mode: the PyTorch path
    got, got_res = rms_norm(x, norm.weight, 1e-6, res, zero_centred=True)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-6
    assert torch.equal(got_res, want_res)
    assert _rel(got, want) < tol
    plain = norm(x)
    assert _rel(rms_norm(x, norm.weight, 1e-6, zero_centred=True), plain) < tol
    assert _rel(rms_norm(x, norm.weight, 1e-6), plain) > 0.1      # the plain weight is another norm
    with torch.inference_mode():            # where the module serves through the kernel
        assert _rel(norm(x), plain) < tol


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("interleaved", [False, True])
def test_slice_rope_equals_the_pytorch_rotation(dtype, interleaved):
    """MLA's rope slice (a strided view of q, and k's single head), with YaRN tables: one kernel."""
    from pipespec.kernels.fused_ops import slice_rope
    from pipespec.model.deepseek.config import YaRN
    from pipespec.model.deepseek.rope import SliceRope
    rope = SliceRope(64, 10000.0, 4096, YaRN(factor=4.0, original_max_position=1024), interleaved).cuda()
    positions = torch.tensor([0, 5, 4095, 17, 1000], device="cuda")
    q = torch.randn(5, 20, 192, device="cuda", dtype=dtype)[..., 128:]          # [T, heads, 64] of a wider head
    for x in (q, torch.randn(5, 1, 64, device="cuda", dtype=dtype)):
        want = rope.rotate(x, positions)            # grad mode: the PyTorch path
        got = slice_rope(x, rope.cos, rope.sin, positions, interleaved)
        assert got.shape == x.shape and got.is_contiguous()
        assert _rel(got, want) < (1e-2 if dtype == torch.bfloat16 else 1e-6)
        with torch.inference_mode():                # where the module serves through the kernel
            assert torch.equal(rope.rotate(x, positions), got)
    assert _rel(slice_rope(q, rope.cos, rope.sin, positions, not interleaved), rope.rotate(q, positions)) > 0.1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gated_rms_norm(dtype):
    from pipespec.kernels.fused_ops import gated_rms_norm
    from pipespec.model.gated_deltanet import GatedRMSNorm
    x = torch.randn(5, 16, 128, device="cuda", dtype=dtype)
    z = torch.randn(5, 16, 256, device="cuda", dtype=dtype)[..., ::2]      # a strided view, as split gives
    norm = GatedRMSNorm(128, 1e-6).cuda().to(dtype)
    norm.weight.data.normal_(1.0, 0.2)
    want = norm(x, z)                       # grad mode: the PyTorch path
    assert _rel(gated_rms_norm(x, z, norm.weight, 1e-6), want) < (1e-2 if dtype == torch.bfloat16 else 1e-6)


def test_silu_mul():
    from pipespec.kernels.fused_ops import silu_mul
    x = torch.randn(9, 2 * 1536, device="cuda", dtype=torch.bfloat16)
    want = torch.nn.functional.silu(x[:, :1536]) * x[:, 1536:]
    assert _rel(silu_mul(x), want) < 1e-2


def test_rope_in_place_matches_reference():
    from pipespec.kernels.fused_ops import rope_
    from pipespec.model.layers import Rope, apply_rope
    cos, sin = torch.randn(300, 64, device="cuda"), torch.randn(300, 64, device="cuda")
    pos = torch.tensor([0, 5, 299, 17], device="cuda")
    qkv = torch.randn(4, 15, 64, device="cuda")
    want = apply_rope(qkv[:, :12].clone(), Rope(cos, sin, pos))    # grad mode: the PyTorch path
    rope_(qkv[:, :12], cos, sin, pos)                                # rotates a strided view in place
    assert _rel(qkv[:, :12], want) < 1e-6


def test_write_kv_skips_padding_slots():
    from pipespec.kernels.fused_ops import write_kv
    kc = torch.zeros(64, 3, 64, device="cuda")
    vc = torch.zeros_like(kc)
    k, v = torch.randn(3, 3, 64, device="cuda"), torch.randn(3, 3, 64, device="cuda")
    write_kv(kc, vc, k, v, torch.tensor([5, -1, 40], device="cuda"))
    assert torch.equal(kc[5], k[0]) and torch.equal(vc[40], v[2])
    kc[5] = 0
    kc[40] = 0
    assert kc.abs().sum() == 0                                      # the -1 row wrote nothing
