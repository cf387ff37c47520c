"""The Triton absorbed-MLA kernel equals the formula on the gathered latents: prefill runs, verify
lines and decode rows of several requests over scattered cache pages (GPU only)."""
import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


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


@pytest.mark.parametrize("dtype,heads,rank,rope", [(torch.float32, 4, 32, 16), (torch.bfloat16, 16, 512, 64),
                                                   (torch.bfloat16, 20, 512, 64), (torch.float32, 3, 24, 8)])
def test_kernel_equals_formula(dtype, heads, rank, rope):
    from pipespec.kernels.mla_attention import mla_paged_attention
    g = torch.Generator(device="cuda").manual_seed(0)
    page, pages = 16, 64
    q_lens, seq_lens = [5, 1, 3, 1, 20], [40, 17, 3, 100, 20]           # verify, decode, prefill, ...
    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), device="cuda")
    tables = torch.randperm(pages, device="cuda", generator=g)[:5 * 8].view(5, 8)
    cache = torch.randn(pages * page, 1, rank + rope + 8, device="cuda", generator=g).to(dtype)  # + indexer room
    t = sum(q_lens)
    q_lat = torch.randn(t, heads, rank, device="cuda", generator=g).to(dtype)
    q_rope = torch.randn(t, heads, rope, device="cuda", generator=g).to(dtype)
    lens = torch.tensor(seq_lens, device="cuda")
    got = mla_paged_attention(q_lat, q_rope, cache, tables, qsl, lens, max(q_lens), rank ** -0.5, page)
    want = _reference(q_lat, q_rope, cache, tables, qsl, lens, rank ** -0.5, page, rank)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
