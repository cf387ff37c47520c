"""`kernels/gated_attention.py` against the PyTorch ops it replaces in `model/qwen3_next.py`'s gated
attention: the q/k norms and partial rotary read from the fused projection's rows, and the output
gate (GPU; on CPU under TRITON_INTERPRET=1, float32 only: the interpreter rounds bf16 its own way)."""
import pytest
import torch

from tests.kernels import DEVICE, INTERPRET, ON_KERNELS

pytestmark = ON_KERNELS
DTYPES = [torch.float32] + ([] if INTERPRET else [torch.bfloat16])


def _tables(head_dim: int, rot: int, max_position: int = 64):
    """`RotaryEmbedding`'s sign-folded tables over the rotated dims, as `qwen3_next.partial_rotary`
    makes them."""
    from pipespec.model.arch import ArchConfig
    from pipespec.model.layers import RotaryEmbedding
    arch = ArchConfig(model_type="llama", vocab_size=32, hidden_size=head_dim, intermediate_size=4 * head_dim,
                      num_layers=1, num_heads=1, num_kv_heads=1, head_dim=rot, rms_norm_eps=1e-6,
                      rope_theta=10000.0, max_position=max_position, tie_word_embeddings=False)
    rope = RotaryEmbedding(arch, max_position).to(DEVICE)
    return rope.cos, rope.sin


def _case(t, heads, kv_heads, d, dtype, extra=5, seed=0):
    """A fused projection's rows (queries and gates interleaved per head, keys, values) wider than
    the three (`extra` columns more: the kernel must use the row stride), and q/k norm weights."""
    g = torch.Generator().manual_seed(seed)
    width = heads * 2 * d + 2 * kv_heads * d
    qkv = torch.randn(t, width + extra, generator=g)[:, :width]
    qw, kw = torch.randn(d, generator=g) * 0.2, torch.randn(d, generator=g) * 0.2
    return qkv.to(DEVICE, dtype), qw.to(DEVICE, dtype), kw.to(DEVICE, dtype)


def _reference(qkv, heads, kv_heads, d, qw, kw, eps, cos, sin, positions):
    """The PyTorch path of `GatedAttention.forward`: split, zero-centred norms, rotate-half RoPE of
    the first dims, in the same dtype steps."""
    from pipespec.model.layers import Rope, apply_rope
    from pipespec.model.norms import ZeroCentredRMSNorm
    t = qkv.shape[0]
    qg, k = qkv[:, :heads * 2 * d], qkv[:, heads * 2 * d:heads * 2 * d + kv_heads * d]
    q = qg.reshape(t, heads, 2 * d)[..., :d]
    out = []
    for x, w in ((q, qw), (k.reshape(t, kv_heads, d), kw)):
        norm = ZeroCentredRMSNorm(d, eps).to(DEVICE, x.dtype)
        with torch.no_grad():                       # not inference mode: the PyTorch path
            norm.weight.copy_(w)
            y = norm(x)
            rot = cos.shape[-1]
            y[..., :rot] = apply_rope(y[..., :rot], Rope(cos, sin, positions))
        out.append(y)
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,heads,kv_heads,d,rot", [(1, 8, 2, 64, 16), (3, 4, 4, 32, 32), (5, 6, 2, 48, 8)])
def test_qk_norm_rope_equals_the_norms_then_the_rotation(dtype, t, heads, kv_heads, d, rot):
    from pipespec.kernels.gated_attention import qk_norm_rope
    qkv, qw, kw = _case(t, heads, kv_heads, d, dtype)
    cos, sin = _tables(d, rot)
    positions = torch.tensor([3, 17, 0, 40, 9][:t], device=DEVICE)
    want_q, want_k = _reference(qkv, heads, kv_heads, d, qw, kw, 1e-6, cos, sin, positions)
    with torch.inference_mode():
        q, k = qk_norm_rope(qkv, heads, kv_heads, d, qw, kw, 1e-6, cos, sin, positions)
    assert q.shape == (t, heads, d) and k.shape == (t, kv_heads, d) and q.is_contiguous() and k.is_contiguous()
    tol = dict(rtol=1e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(q, want_q, **tol)
    torch.testing.assert_close(k, want_k, **tol)
    # against the norms alone (an identity rotation): the leading dims turned, the others did not
    normed_q, _ = _reference(qkv, heads, kv_heads, d, qw, kw, 1e-6, torch.ones_like(cos), torch.zeros_like(sin),
                             positions)
    torch.testing.assert_close(q[..., rot:], normed_q[..., rot:], **tol)
    assert (q[..., :rot] - normed_q[..., :rot]).abs().max() > 0.1


def test_qk_norm_rope_refuses_a_rotary_width_it_cannot_take():
    from pipespec.kernels.gated_attention import qk_norm_rope, rotary_fits
    assert rotary_fits(64, 256) and rotary_fits(2, 8) and not rotary_fits(12, 64) and not rotary_fits(128, 64)
    qkv, qw, kw = _case(1, 2, 1, 32, torch.float32)
    cos, sin = _tables(32, 12)
    with pytest.raises(ValueError, match="rotary width"):
        qk_norm_rope(qkv, 2, 1, 32, qw, kw, 1e-6, cos, sin, torch.zeros(1, dtype=torch.long, device=DEVICE))


@pytest.mark.parametrize("dtype", DTYPES)
def test_sigmoid_gate_reads_each_heads_gate_in_place(dtype):
    from pipespec.kernels.gated_attention import sigmoid_gate
    t, heads, kv_heads, d = 3, 4, 2, 48
    qkv, _, _ = _case(t, heads, kv_heads, d, dtype, seed=1)
    x = torch.randn(t, heads * d, generator=torch.Generator().manual_seed(2)).to(DEVICE, dtype)
    gate = qkv[:, :heads * 2 * d].reshape(t, heads, 2 * d)[..., d:].reshape(t, -1)
    with torch.inference_mode():
        got = sigmoid_gate(x, qkv, heads, d)
    want = x * torch.sigmoid(gate)
    if dtype == torch.bfloat16:                     # the same rounding steps as torch's
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(got, x * torch.sigmoid(qkv[:, :heads * d]), atol=1e-3)   # not the queries
