"""The Triton absorbed-MLA kernel equals the formula on the gathered latents: prefill runs, verify
lines and decode rows of several requests over scattered cache pages, with the keys split over
programs or not (GPU; on CPU under TRITON_INTERPRET=1 in float32)."""
import pytest
import torch

from tests.kernels import DEVICE, INTERPRET, ON_KERNELS

pytestmark = ON_KERNELS


def _reference(q_lat, q_rope, cache, tables, qsl, seq_lens, scale, page, rank):
    out = torch.empty_like(q_lat, dtype=torch.float32)
    for b in range(seq_lens.shape[0]):
        lo, hi, n = int(qsl[b]), int(qsl[b + 1]), int(seq_lens[b])
        slots = tables[b, torch.arange(n, device=cache.device) // page] * page + torch.arange(n, device=cache.device) % page
        kv = cache[slots, 0].float()
        lat, rope = kv[:, :rank], kv[:, rank:]
        s = (torch.einsum("thr,nr->thn", q_lat[lo:hi].float(), lat)
             + torch.einsum("thd,nd->thn", q_rope[lo:hi].float(), rope[:, :q_rope.shape[-1]])) * scale
        pos = n - (hi - lo) + torch.arange(hi - lo, device=cache.device)
        s = s.masked_fill(torch.arange(n, device=cache.device)[None, None, :] > pos[:, None, None], float("-inf"))
        out[lo:hi] = torch.einsum("thn,nr->thr", s.softmax(-1), lat)
    return out


def _case(dtype, heads, rank, rope, q_lens, seq_lens, width=8, seed=0):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    page, batch = 16, len(q_lens)
    pages = batch * width
    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), device=DEVICE)
    tables = torch.randperm(pages, device=DEVICE, generator=g).view(batch, width)
    cache = torch.randn(pages * page, 1, rank + rope + 8, device=DEVICE, generator=g).to(dtype)  # + indexer room
    t = sum(q_lens)
    q_lat = torch.randn(t, heads, rank, device=DEVICE, generator=g).to(dtype)
    q_rope = torch.randn(t, heads, rope, device=DEVICE, generator=g).to(dtype)
    return q_lat, q_rope, cache, tables, qsl, torch.tensor(seq_lens, device=DEVICE), page


CASES = [(torch.float32, 4, 32, 16), (torch.float32, 3, 24, 8)]
if not INTERPRET:
    CASES += [(torch.bfloat16, 16, 512, 64), (torch.bfloat16, 20, 512, 64)]
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype,heads,rank,rope", CASES)
@pytest.mark.parametrize("num_splits", [1, 3, 16])
def test_kernel_equals_formula(dtype, heads, rank, rope, num_splits):
    """Verify, decode, prefill, a long decode and a prefill run in one step; with 16 splits the
    short contexts leave most splits empty (at least MIN_CHUNK keys a split), 3 splits cut the
    100-key context inside a page."""
    from pipespec.kernels.mla_attention import mla_paged_attention
    q_lens, seq_lens = [5, 1, 3, 1, 20], [40, 17, 3, 100, 20]
    q_lat, q_rope, cache, tables, qsl, lens, page = _case(dtype, heads, rank, rope, q_lens, seq_lens)
    got = mla_paged_attention(q_lat, q_rope, cache, tables, qsl, lens, max(q_lens), rank ** -0.5, page,
                              num_splits=num_splits)
    want = _reference(q_lat, q_rope, cache, tables, qsl, lens, rank ** -0.5, page, rank)
    torch.testing.assert_close(got.float(), want, atol=TOL[dtype], rtol=TOL[dtype])


def test_splits_cover_a_long_context():
    """Decode rows over 1,000+ keys split into chunks of MIN_CHUNK keys: every split has work and the
    merge weighs them by their maxima (a merge that dropped a split would miss its keys)."""
    from pipespec.kernels.mla_attention import MIN_CHUNK, mla_paged_attention
    q_lat, q_rope, cache, tables, qsl, lens, page = _case(torch.float32, 4, 32, 16, [1, 1], [1000, 640],
                                                          width=64, seed=3)
    want = _reference(q_lat, q_rope, cache, tables, qsl, lens, 0.3, page, 32)
    for splits in (1000 // MIN_CHUNK, 7):
        got = mla_paged_attention(q_lat, q_rope, cache, tables, qsl, lens, 1, 0.3, page, num_splits=splits)
        torch.testing.assert_close(got.float(), want, atol=2e-5, rtol=2e-5)


def test_default_split_follows_the_block_table():
    """A graph's block tables span max_model_len, so batch-1 decode rows split; short tables (an
    eager step over a short context) take one program."""
    from pipespec.kernels.mla_attention import MIN_CHUNK
    from pipespec.kernels.kv_split import num_kv_splits
    assert num_kv_splits(2, 32768, 132, min_kv=2 * MIN_CHUNK, keys_per_split=MIN_CHUNK) == 128
    assert num_kv_splits(2, 64, 132, min_kv=2 * MIN_CHUNK, keys_per_split=MIN_CHUNK) == 1
    assert num_kv_splits(128, 4096, 132, min_kv=2 * MIN_CHUNK, keys_per_split=MIN_CHUNK) == 5
