"""The Triton paged-attention kernel against the PyTorch reference backend, whole and with the KV
split across programs (GPU; on CPU under TRITON_INTERPRET=1 in float32)."""

import pytest
import torch

from pipespec.model.attention import ForwardContext, KVCache, TorchReferenceBackend
from tests.kernels import DEVICE, ON_KERNELS

# the interpreter multiplies bf16 tiles as their bit patterns: float32 only there
DTYPES = [torch.bfloat16, torch.float32] if torch.cuda.is_available() else [torch.float32]
pytestmark = ON_KERNELS

# (query rows, KV length after the step) per request: decode, verify, a whole prefill, a prefill
# chunk reading earlier blocks, and a long context
MIXES = {
    "decode": [(1, 7), (1, 130), (1, 16), (1, 1)],
    "verify": [(4, 9), (4, 200), (4, 4), (4, 77)],
    "prefill": [(37, 37), (128, 128), (5, 5)],
    "mixed": [(1, 50), (64, 300), (4, 33), (17, 17), (1, 1000)],
}


def _case(mix, heads, kv_heads, dim, dtype, page=16, seed=0):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    dev = DEVICE
    widths = [-(-s // page) for _, s in mix]
    num_blocks = sum(widths) + 8
    key = torch.randn(num_blocks * page, kv_heads, dim, generator=g, device=dev).to(dtype)
    value = torch.randn(num_blocks * page, kv_heads, dim, generator=g, device=dev).to(dtype)
    perm = torch.randperm(num_blocks, generator=g, device=dev)   # scattered pages
    tables = torch.zeros(len(mix), max(widths), dtype=torch.int64, device=dev)
    used = 0
    for i, w in enumerate(widths):
        tables[i, :w] = perm[used:used + w]
        used += w
    q_lens = torch.tensor([q for q, _ in mix], device=dev)
    seq_lens = torch.tensor([s for _, s in mix], device=dev)
    qsl = torch.cat((torch.zeros(1, dtype=torch.int64, device=dev), q_lens.cumsum(0)))
    positions = torch.cat([torch.arange(s - q, s, device=dev) for q, s in mix])
    q = torch.randn(int(qsl[-1]), heads, dim, generator=g, device=dev).to(dtype)
    return q, key, value, tables, qsl, seq_lens, positions, max(q for q, _ in mix)


def _reference(q, key, value, tables, qsl, seq_lens, positions, page):
    backend = TorchReferenceBackend()
    meta = backend.prepare(qsl, seq_lens, positions, tables, page)
    req = torch.repeat_interleave(torch.arange(len(seq_lens), device=q.device), qsl[1:] - qsl[:-1])
    slots = tables[req, positions // page] * page + positions % page
    ctx = ForwardContext(positions, slots, backend, meta, [])
    cache = KVCache(key.float().clone(), value.float().clone())
    return backend.forward(q.float(), key[slots].float(), value[slots].float(), cache, ctx, q.shape[-1] ** -0.5)


@pytest.mark.parametrize("mix", sorted(MIXES))
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (32, 8, 128), (4, 4, 64)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_matches_reference(mix, heads, kv_heads, dim, dtype):
    from pipespec.kernels.paged_attention import paged_attention
    q, key, value, tables, qsl, seq_lens, positions, max_q = _case(MIXES[mix], heads, kv_heads, dim, dtype)
    want = _reference(q, key, value, tables, qsl, seq_lens, positions, 16)
    got = paged_attention(q, key, value, tables, qsl, seq_lens, max_q, dim ** -0.5, 16).float()
    err = (got - want).norm() / want.norm()
    assert err < (2e-2 if dtype == torch.bfloat16 else 1e-5), f"relative error {err:.2e}"


def test_kernel_reads_strided_queries():
    """q as a view into the fused qkv rows (row stride larger than heads * dim), as the model passes it."""
    from pipespec.kernels.paged_attention import paged_attention
    q, key, value, tables, qsl, seq_lens, positions, max_q = _case(MIXES["mixed"], 9, 3, 64, torch.float32)
    wide = torch.randn(q.shape[0], 15, 64, device=DEVICE)
    wide[:, :9] = q
    got = paged_attention(wide[:, :9], key, value, tables, qsl, seq_lens, max_q, 0.125, 16)
    want = paged_attention(q, key, value, tables, qsl, seq_lens, max_q, 0.125, 16)
    assert torch.equal(got, want)


@pytest.mark.parametrize("mix", ["decode", "verify", "mixed"])
@pytest.mark.parametrize("num_splits", [2, 5, 32])
@pytest.mark.parametrize("dtype", DTYPES)
def test_split_kv_matches_reference(mix, num_splits, dtype):
    """Each program's keys split over `num_splits` programs and merged (splits that get no keys,
    short contexts in one batch with long ones, verify rows' causal masks, GQA groups)."""
    from pipespec.kernels.paged_attention import paged_attention
    q, key, value, tables, qsl, seq_lens, positions, max_q = _case(MIXES[mix], 32, 8, 128, dtype, seed=1)
    want = _reference(q, key, value, tables, qsl, seq_lens, positions, 16)
    got = paged_attention(q, key, value, tables, qsl, seq_lens, max_q, 128 ** -0.5, 16, num_splits=num_splits).float()
    err = (got - want).norm() / want.norm()
    assert err < (2e-2 if dtype == torch.bfloat16 else 1e-5), f"relative error {err:.2e}"


def test_default_splits_fill_the_slots_of_the_compiled_kernel():
    """Decode rows of 64 requests (SmolLM2's 9 / 3 heads of 64) over a 4,096-token table: the split
    count is the wave rule's over SMs x the programs of the compiled split variant an SM holds (any
    sm_80+ GPU holds two of its <= 255 registers a thread; the interpreter compiles nothing: one)."""
    from pipespec.kernels import sm_count
    from pipespec.kernels.kv_split import wave_splits
    from pipespec.kernels.paged_attention import _RESIDENT, kv_splits
    batch, page, width = 64, 16, 256
    q = torch.zeros(batch, 9, 64, device=DEVICE)
    cache = torch.zeros(batch * width * page, 3, 64, device=DEVICE)
    tables = torch.arange(batch * width, device=DEVICE).view(batch, width)
    qsl = torch.arange(batch + 1, device=DEVICE)
    seq_lens = torch.full((batch,), width * page, device=DEVICE)
    splits = kv_splits(q, cache, cache, tables, qsl, seq_lens, 1, page)
    # the decode tile: 16 query rows, 128 keys a step, 3 stages, 4 warps
    resident = _RESIDENT[(q.device, q.dtype, cache.dtype, 9, 3, 64, page, 16, 128, 3, 4)]
    assert resident >= 2 if torch.cuda.is_available() else resident == 1
    assert splits == wave_splits(batch * 3, width * page, sm_count(q.device) * resident, 128)
