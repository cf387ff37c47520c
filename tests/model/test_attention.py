"""The reference (CPU) attention backend: short queries grouped by context length, against attention
computed one request at a time."""
import torch
import torch.nn.functional as F

from pipespec.model.attention import ForwardContext, KVCache, TorchReferenceBackend, length_groups


def test_length_groups_bound_padding_and_merge_small_groups():
    lens = [8, 361, 40, 300, 90, 181, 180, 75, 350]
    groups = length_groups(list(range(len(lens))), lens)
    assert sorted(i for g in groups for i in g) == list(range(len(lens)))
    assert all(lens[g[0]] == max(lens[i] for i in g) for g in groups)        # the longest first
    # down to half of the longest, except where a group too small to pay for its call took more
    assert [sorted(lens[i] for i in g) for g in groups] == [[181, 300, 350, 361], [90, 180], [8, 40, 75]]
    padded = sum(len(g) * lens[g[0]] for g in groups)
    assert padded == 4 * 361 + 2 * 180 + 3 * 75 < len(lens) * 361 * 0.7
    assert length_groups([0, 1], [10, 200]) == [[1, 0]]       # one small request is not worth a call
    assert length_groups([], []) == []
    assert length_groups([2, 0], [100, 5, 100]) == [[2, 0]]   # members only, of equal length: one group


def test_grouped_decode_and_a_prefill_chunk_attend_as_each_request_alone():
    torch.manual_seed(0)
    heads, kv_heads, dim, block = 4, 2, 8, 4
    ctx_lens = [300, 37, 290, 140, 6]         # decode rows (one query each) of very different lengths...
    chunk, chunk_ctx = 20, 26                 # ...and a prefill chunk of 20 rows after 6 cached tokens
    seq_lens = ctx_lens + [chunk_ctx]
    q_lens = [1] * len(ctx_lens) + [chunk]
    blocks = [-(-n // block) for n in seq_lens]
    tables = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int64)
    perm = torch.randperm(sum(blocks))        # blocks scattered over the cache
    for i, (n, start) in enumerate(zip(blocks, torch.tensor([0] + blocks).cumsum(0).tolist())):
        tables[i, :n] = perm[start:start + n]
    slots = sum(blocks) * block
    cache = KVCache(torch.randn(slots, kv_heads, dim), torch.randn(slots, kv_heads, dim))
    qsl = torch.tensor([0] + q_lens).cumsum(0)
    positions = torch.cat([torch.arange(n - q, n) for n, q in zip(seq_lens, q_lens)])
    slot_of = lambda i, p: int(tables[i, p // block]) * block + p % block            # noqa: E731
    slot_mapping = torch.tensor([slot_of(i, p) for i, (n, q) in enumerate(zip(seq_lens, q_lens))
                                 for p in range(n - q, n)])
    t = int(qsl[-1])
    q, k, v = torch.randn(t, heads, dim), torch.randn(t, kv_heads, dim), torch.randn(t, kv_heads, dim)

    backend = TorchReferenceBackend()
    meta = backend.prepare(qsl, torch.tensor(seq_lens), positions, tables, block)
    assert len(meta) == 4                     # decode rows in three length groups, the chunk alone
    out = backend.forward(q, k, v, cache, ForwardContext(positions, slot_mapping, backend, meta, []), 0.3)

    for i, (n, ql) in enumerate(zip(seq_lens, q_lens)):
        keys = torch.stack([cache.key[slot_of(i, p)] for p in range(n)]).transpose(0, 1)     # [KVH, n, D]
        vals = torch.stack([cache.value[slot_of(i, p)] for p in range(n)]).transpose(0, 1)
        rows = slice(int(qsl[i]), int(qsl[i + 1]))
        allowed = torch.arange(n)[None, :] <= torch.arange(n - ql, n)[:, None]
        want = F.scaled_dot_product_attention(q[rows].transpose(0, 1), keys, vals, attn_mask=allowed, scale=0.3,
                                              enable_gqa=True).transpose(0, 1)
        torch.testing.assert_close(out[rows], want, rtol=1e-5, atol=1e-5)
