"""Fused elementwise kernels against the PyTorch ops they replace (GPU; on CPU under
TRITON_INTERPRET=1)."""
import pytest
import torch

from tests.kernels import DEVICE, INTERPRET, ON_KERNELS

pytestmark = ON_KERNELS
# the interpreter rounds bfloat16 its own way (numpy): there only float32 is checked
DTYPES = [torch.float32] + ([] if INTERPRET else [torch.bfloat16])


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_with_and_without_residual(dtype):
    from pipespec.kernels.fused_ops import rms_norm
    from pipespec.model.layers import RMSNorm
    x = torch.randn(37, 576, device=DEVICE, dtype=dtype)
    res = torch.randn_like(x)
    norm = RMSNorm(576, 1e-5).to(DEVICE).to(dtype)
    norm.weight.data.normal_(1.0, 0.2)
    want, want_res = norm(x, res)           # grad mode: the PyTorch path
    got, got_res = rms_norm(x, norm.weight, 1e-5, res)
    assert torch.equal(got_res, want_res)
    assert _rel(got, want) < (1e-2 if dtype == torch.bfloat16 else 1e-6)
    assert _rel(rms_norm(x, norm.weight, 1e-5), norm(x)) < (1e-2 if dtype == torch.bfloat16 else 1e-6)


def test_rms_norm_reads_a_slice_of_wider_rows_in_place():
    """MLA's q latent is the first columns of the fused latent projection's rows: the kernel reads
    it with its row stride (no copy) and writes contiguous rows."""
    from pipespec.kernels.fused_ops import rms_norm
    from pipespec.model.layers import RMSNorm
    fused = torch.randn(5, 96 + 40, device=DEVICE)
    q_a = fused.split([96, 40], dim=-1)[0]
    norm = RMSNorm(96, 1e-6).to(DEVICE)
    norm.weight.data.normal_(1.0, 0.2)
    got = rms_norm(q_a, norm.weight, 1e-6)
    assert got.is_contiguous() and _rel(got, norm(q_a.contiguous())) < 1e-6
    assert _rel(rms_norm(fused[:, 40:], norm.weight, 1e-6), norm(fused[:, 40:].contiguous())) < 1e-6


@pytest.mark.parametrize("dtype", DTYPES)
def test_zero_centred_rms_norm(dtype):
    """Qwen3.5's (1 + w) norm: one kernel, with and without a residual, also on a strided view of
    per-head rows (the gated attention's q)."""
    from pipespec.kernels.fused_ops import rms_norm
    from pipespec.model.norms import ZeroCentredRMSNorm
    x = torch.randn(7, 6, 2 * 128, device=DEVICE, dtype=dtype)[..., :128]
    res = torch.randn_like(x)
    norm = ZeroCentredRMSNorm(128, 1e-6).to(DEVICE).to(dtype)
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


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [False, True])
def test_slice_rope_equals_the_pytorch_rotation(dtype, interleaved):
    """MLA's rope slice (a strided view of q, and k's single head), with YaRN tables: one kernel."""
    from pipespec.kernels.fused_ops import slice_rope
    from pipespec.model.deepseek.config import YaRN
    from pipespec.model.deepseek.rope import SliceRope
    rope = SliceRope(64, 10000.0, 4096, YaRN(factor=4.0, original_max_position=1024), interleaved).to(DEVICE)
    positions = torch.tensor([0, 5, 4095, 17, 1000], device=DEVICE)
    q = torch.randn(5, 20, 192, device=DEVICE, dtype=dtype)[..., 128:]          # [T, heads, 64] of a wider head
    for x in (q, torch.randn(5, 1, 64, device=DEVICE, dtype=dtype)):
        want = rope.rotate(x, positions)            # grad mode: the PyTorch path
        got = slice_rope(x, rope.cos, rope.sin, positions, interleaved)
        assert got.shape == x.shape and got.is_contiguous()
        assert _rel(got, want) < (1e-2 if dtype == torch.bfloat16 else 1e-6)
        with torch.inference_mode():                # where the module serves through the kernel
            assert torch.equal(rope.rotate(x, positions), got)
    assert _rel(slice_rope(q, rope.cos, rope.sin, positions, not interleaved), rope.rotate(q, positions)) > 0.1


@pytest.mark.parametrize("dtype", DTYPES)
def test_gated_rms_norm(dtype):
    from pipespec.kernels.fused_ops import gated_rms_norm
    from pipespec.model.gated_deltanet import GatedRMSNorm
    x = torch.randn(5, 16, 128, device=DEVICE, dtype=dtype)
    z = torch.randn(5, 16, 256, device=DEVICE, dtype=dtype)[..., ::2]      # a strided view, as split gives
    norm = GatedRMSNorm(128, 1e-6).to(DEVICE).to(dtype)
    norm.weight.data.normal_(1.0, 0.2)
    want = norm(x, z)                       # grad mode: the PyTorch path
    assert _rel(gated_rms_norm(x, z, norm.weight, 1e-6), want) < (1e-2 if dtype == torch.bfloat16 else 1e-6)


def test_silu_mul():
    from pipespec.kernels.fused_ops import silu_mul
    x = torch.randn(9, 2 * 1536, device=DEVICE, dtype=DTYPES[-1])
    want = torch.nn.functional.silu(x[:, :1536]) * x[:, 1536:]
    assert _rel(silu_mul(x), want) < 1e-2


def test_rope_in_place_matches_reference():
    from pipespec.kernels.fused_ops import rope_
    from pipespec.model.layers import Rope, apply_rope
    cos, sin = torch.randn(300, 64, device=DEVICE), torch.randn(300, 64, device=DEVICE)
    pos = torch.tensor([0, 5, 299, 17], device=DEVICE)
    qkv = torch.randn(4, 15, 64, device=DEVICE)
    want = apply_rope(qkv[:, :12].clone(), Rope(cos, sin, pos))    # grad mode: the PyTorch path
    rope_(qkv[:, :12], cos, sin, pos)                                # rotates a strided view in place
    assert _rel(qkv[:, :12], want) < 1e-6


def test_write_kv_skips_padding_slots():
    from pipespec.kernels.fused_ops import write_kv
    kc = torch.zeros(64, 3, 64, device=DEVICE)
    vc = torch.zeros_like(kc)
    k, v = torch.randn(3, 3, 64, device=DEVICE), torch.randn(3, 3, 64, device=DEVICE)
    write_kv(kc, vc, k, v, torch.tensor([5, -1, 40], device=DEVICE))
    assert torch.equal(kc[5], k[0]) and torch.equal(vc[40], v[2])
    kc[5] = 0
    kc[40] = 0
    assert kc.abs().sum() == 0                                      # the -1 row wrote nothing


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [False, True])
def test_mla_cache_entry_equals_norm_rope_and_write(dtype, interleaved):
    """MLA's cache entry in one kernel: the normed latent, then the rotated rope key, at each row's
    slot (a -1 slot writes nothing); the same values as the layer's PyTorch ops stored one by one."""
    from pipespec.kernels.fused_ops import mla_cache_entry
    from pipespec.model.deepseek.config import YaRN
    from pipespec.model.deepseek.rope import SliceRope
    from pipespec.model.layers import RMSNorm
    rank, dr = 96, 16
    rope = SliceRope(dr, 10000.0, 512, YaRN(factor=4.0, original_max_position=128), interleaved).to(DEVICE)
    norm = RMSNorm(rank, 1e-6).to(DEVICE).to(dtype)
    norm.weight.data.normal_(1.0, 0.2)
    kv_a = torch.randn(4, rank + dr + 8, device=DEVICE, dtype=dtype)[:, :rank + dr]      # rows of a wider buffer
    positions = torch.tensor([0, 7, 511, 100], device=DEVICE)
    slots = torch.tensor([3, 9, -1, 0], device=DEVICE)
    cache = torch.zeros(12, 1, rank + dr + 4, device=DEVICE, dtype=dtype)
    mla_cache_entry(kv_a, norm.weight, norm.eps, rope.cos, rope.sin, positions, interleaved, cache, slots)
    latent, k_rope = kv_a.split([rank, dr], dim=-1)
    want = torch.cat([norm(latent), rope.rotate(k_rope[:, None, :], positions)[:, 0]], dim=-1)   # PyTorch path
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-6
    for row, slot in ((0, 3), (1, 9), (3, 0)):
        assert _rel(cache[slot, 0, :rank + dr], want[row]) < tol
    assert cache[slot, 0, rank + dr:].abs().sum() == 0                  # nothing past the entry
    written = torch.zeros(12, dtype=torch.bool)
    written[[3, 9, 0]] = True
    assert cache[~written.to(DEVICE)].abs().sum() == 0                    # the -1 row wrote nothing
    flipped = torch.zeros_like(cache)
    mla_cache_entry(kv_a, norm.weight, norm.eps, rope.cos, rope.sin, positions, not interleaved, flipped, slots)
    assert _rel(flipped[3, 0, rank:rank + dr], want[0, rank:]) > 0.1    # the pair layout matters
