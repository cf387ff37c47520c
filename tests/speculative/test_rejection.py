"""The rejection sampler: output distribution equals the target's, greedy semantics, keyed draws."""
import math

import pytest
import torch

from pipespec.sampling import SamplingTensors, processed_probs, sample
from pipespec.speculative.rejection import rejection_sample

V = 8


def _st(n, temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0, seed0=0):
    return SamplingTensors(torch.full((n,), float(temperature)), torch.full((n,), top_k, dtype=torch.int64),
                           torch.full((n,), float(top_p)), torch.full((n,), float(min_p)),
                           torch.arange(seed0, seed0 + n, dtype=torch.int64),
                           needs_sort=top_k > 0 or top_p < 1.0, all_greedy=temperature == 0)


def _chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Upper tail of chi-square (Wilson-Hilferty normal approximation), over cells with mass."""
    n = counts.sum().item()
    keep = probs > 0
    expected = probs[keep] * n
    stat = (((counts[keep] - expected) ** 2) / expected).sum().item()
    dof = int(keep.sum()) - 1
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


@pytest.mark.parametrize("filters", [{}, {"top_k": 5}, {"top_p": 0.8}, {"top_k": 6, "top_p": 0.9, "min_p": 0.02}])
@pytest.mark.parametrize("k", [1, 3])
def test_output_follows_target_distribution(filters, k):
    torch.manual_seed(len(filters) * 10 + k)
    n = 200_000
    target_logits = torch.randn(V) * 1.5
    draft_logits = torch.randn(k, V) * 1.5
    q = draft_logits.softmax(-1)                               # a draft distribution unlike p
    st = _st(n, temperature=0.9, **filters)
    logits = target_logits.expand(n, k + 1, V).clone()
    gen = torch.Generator().manual_seed(1)
    drafts = torch.stack([torch.multinomial(q[j], n, replacement=True, generator=gen) for j in range(k)], 1)
    tokens, num = rejection_sample(logits, drafts, torch.full((n,), k), st, torch.full((n,), 5),
                                   draft_probs=q.expand(n, k, V))
    p = processed_probs(target_logits[None], _st(1, temperature=0.9, **filters))[0]
    # every emitted position follows p: the first token, and the second where one was emitted
    counts = torch.bincount(tokens[:, 0], minlength=V).double()
    assert _chi_square_p_value(counts, p.double()) > 1e-4
    assert counts[p == 0].sum() == 0                          # filtered tokens never appear
    second = tokens[num >= 2, 1]
    assert _chi_square_p_value(torch.bincount(second, minlength=V).double(), p.double()) > 1e-4
    accept_rate = (num - 1).float().mean().item()
    assert 0 < accept_rate < k                                 # q differs from p: some, not all, accepted


def test_deterministic_drafts_one_hot_q_follow_target():
    torch.manual_seed(3)
    n = 200_000
    target_logits = torch.randn(V)
    logits = target_logits.expand(n, 2, V).clone()
    drafts = torch.full((n, 1), int(target_logits.argmax()))   # a greedy drafter
    tokens, num = rejection_sample(logits, drafts, torch.ones(n, dtype=torch.int64), _st(n),
                                   torch.zeros(n, dtype=torch.int64))
    counts = torch.bincount(tokens[:, 0], minlength=V).double()
    assert _chi_square_p_value(counts, target_logits.softmax(-1).double()) > 1e-4


def test_greedy_accepts_prefix_and_corrects():
    logits = torch.full((2, 4, V), -5.0)
    best = [[1, 2, 3, 4], [5, 6, 7, 0]]
    for b in range(2):
        for j, t in enumerate(best[b]):
            logits[b, j, t] = 5.0
    drafts = torch.tensor([[1, 2, 3], [5, 1, 7]])
    tokens, num = rejection_sample(logits, drafts, torch.tensor([3, 3]), _st(2, temperature=0.0),
                                   torch.tensor([10, 20]))
    assert num.tolist() == [4, 2]
    assert tokens[0].tolist() == [1, 2, 3, 4]                 # all accepted + bonus
    assert tokens[1].tolist() == [5, 6, -1, -1]               # second draft wrong: corrected to argmax


def test_fewer_drafts_than_width_and_no_drafts_equal_plain_sampling():
    torch.manual_seed(0)
    logits = torch.randn(3, 3, V)
    st = _st(3, temperature=0.7)
    first = torch.tensor([4, 9, 2])
    tokens, num = rejection_sample(logits, torch.zeros(3, 2, dtype=torch.int64), torch.zeros(3, dtype=torch.int64),
                                   st, first)
    assert num.tolist() == [1, 1, 1]
    assert tokens[:, 0].tolist() == sample(logits[:, 0], st, first).tolist()
    assert (tokens[:, 1:] == -1).all()


def test_keyed_by_seed_and_position_not_batch():
    torch.manual_seed(1)
    logits = torch.randn(4, 3, V)
    drafts = torch.randint(0, V, (4, 2))
    st = _st(4, temperature=1.0)
    first = torch.tensor([3, 8, 1, 6])
    tokens, num = rejection_sample(logits, drafts, torch.full((4,), 2), st, first)
    for i in range(4):
        one = SamplingTensors(st.temperature[i:i + 1], st.top_k[i:i + 1], st.top_p[i:i + 1], st.min_p[i:i + 1],
                              st.seed[i:i + 1], False, False)
        t1, n1 = rejection_sample(logits[i:i + 1], drafts[i:i + 1], torch.tensor([2]), one, first[i:i + 1])
        assert t1[0].tolist() == tokens[i].tolist() and n1.item() == num[i].item()
