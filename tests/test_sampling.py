"""Keyed randomness and sampling (pipespec.sampling), with no model."""
from __future__ import annotations

import math

import pytest
import torch

from pipespec.sampling import SamplingParams, SamplingTensors, processed_probs, sample, uniform_keyed

# chi-square critical values at p = 1e-4 (df -> value), used when scipy is not installed
_CHI2_CRIT_1E4 = {1: 15.137, 2: 18.421, 3: 21.108, 4: 23.513, 5: 25.745, 6: 27.856, 7: 29.878, 8: 31.828,
                  9: 33.720, 10: 35.564, 11: 37.367}


def chi2_ok(counts: torch.Tensor, probs: torch.Tensor, alpha: float = 1e-4) -> tuple[bool, float]:
    """Pearson's chi-square goodness of fit over the outcomes with non-zero expected count."""
    n = counts.sum().item()
    keep = probs > 0
    expected = probs[keep].double() * n
    stat = (((counts[keep].double() - expected) ** 2) / expected).sum().item()
    df = int(keep.sum()) - 1
    try:
        from scipy.stats import chi2
        return chi2.sf(stat, df) > alpha, stat
    except ImportError:
        return stat < _CHI2_CRIT_1E4[df], stat


def tensors(rows: int, temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0, seed=0) -> SamplingTensors:
    full = lambda v, dt: torch.full((rows,), v, dtype=dt)
    return SamplingTensors(temperature=full(temperature, torch.float32), top_k=full(top_k, torch.int64),
                           top_p=full(top_p, torch.float32), min_p=full(min_p, torch.float32),
                           seed=full(seed, torch.int64), needs_sort=top_k > 0 or top_p < 1.0,
                           all_greedy=temperature == 0.0)


LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])


# -- keyed uniforms ------------------------------------------------------------------------------


def test_uniform_keyed_is_a_pure_function():
    seeds = torch.tensor([0, 1, 2**40 + 7, 2**62 + 12345, 5], dtype=torch.int64)
    pos = torch.tensor([0, 17, 17, 4000, 8191], dtype=torch.int64)
    a = uniform_keyed(seeds, pos, 64)
    b = uniform_keyed(seeds.clone(), pos.clone(), 64)
    assert a.shape == (5, 64) and a.dtype == torch.float32
    assert torch.equal(a, b)
    # row-wise: a row does not depend on the other rows of the batch
    for i in range(5):
        assert torch.equal(uniform_keyed(seeds[i:i + 1], pos[i:i + 1], 64)[0], a[i])
    # a prefix of the columns does not depend on the width
    assert torch.equal(uniform_keyed(seeds, pos, 16), a[:, :16])


def test_uniform_keyed_differs_across_inputs():
    base = uniform_keyed(torch.tensor([42]), torch.tensor([10]), 256)
    other_pos = uniform_keyed(torch.tensor([42]), torch.tensor([11]), 256)
    other_seed = uniform_keyed(torch.tensor([43]), torch.tensor([10]), 256)
    high_seed = uniform_keyed(torch.tensor([42 + 2**32]), torch.tensor([10]), 256)   # high word matters
    other_stream = uniform_keyed(torch.tensor([42]), torch.tensor([10]), 256, stream=1)
    for other in (other_pos, other_seed, high_seed, other_stream):
        assert (base != other).float().mean() > 0.99
    # columns of one row differ too
    assert base.unique().numel() > 250


def test_uniform_keyed_range_and_uniformity():
    n_rows = 2000
    u = uniform_keyed(torch.full((n_rows,), 7, dtype=torch.int64), torch.arange(n_rows), 50).flatten().double()
    assert (u > 0).all() and (u < 1).all()
    n = u.numel()
    assert abs(u.mean().item() - 0.5) < 4 * math.sqrt(1 / 12 / n)
    assert abs(u.var().item() - 1 / 12) < 0.002
    # Kolmogorov-Smirnov distance against U(0, 1); the 1e-4 critical value is about 2.2 / sqrt(n)
    s = u.sort().values
    i = torch.arange(1, n + 1, dtype=torch.float64)
    ks = torch.maximum(i / n - s, s - (i - 1) / n).max().item()
    assert ks < 2.2 / math.sqrt(n), ks
    # decile counts: chi-square
    counts = torch.bincount((u * 10).long(), minlength=10)
    ok, stat = chi2_ok(counts, torch.full((10,), 0.1))
    assert ok, stat
    # neighbouring positions are not correlated
    a = uniform_keyed(torch.full((n_rows,), 7), torch.arange(n_rows), 1)[:, 0].double()
    corr = torch.corrcoef(torch.stack([a[:-1], a[1:]]))[0, 1].item()
    assert abs(corr) < 4 / math.sqrt(n_rows)


# (seed, position, column) where the hash takes its largest 24-bit value, found by a search; the
# uniform there used to round up to exactly 1.0, so -log(u) = 0 and a token of probability 0 won the
# exponential race as NaN (about one sampled token in 340 with a 49k vocabulary).
EXTREME = dict(seed=101, position=7, column=6364, width=49152)


def test_uniform_keyed_stays_inside_open_interval_at_extreme_hash():
    u = uniform_keyed(torch.tensor([EXTREME["seed"]]), torch.tensor([EXTREME["position"]]), EXTREME["width"])[0]
    assert int(u.argmax()) == EXTREME["column"], "the search result no longer points at the extreme value"
    assert u.max().item() < 1.0 and u.min().item() > 0.0
    assert torch.isfinite(-torch.log(u)).all() and (-torch.log(u) > 0).all()


def test_filtered_tokens_are_never_drawn_at_extreme_hash():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, EXTREME["width"], generator=g) * 3
    st = tensors(3, temperature=1.0, top_k=50, seed=EXTREME["seed"])
    st.temperature[0] = 0.0              # a greedy row in a batch that samples
    st.top_k[2] = -1
    st.top_p[2] = 0.5
    out = sample(logits, st, torch.full((3,), EXTREME["position"]))
    assert int(out[0]) == int(logits[0].argmax())
    assert int(out[1]) in logits[1].topk(50).indices.tolist()
    assert processed_probs(logits[2:], tensors(1, top_p=0.5))[0, out[2]] > 0


# -- processed distribution ------------------------------------------------------------------------


def softmax(x, t=1.0):
    return torch.softmax(x / t, dim=-1)


def test_processed_probs_plain_temperature():
    for t in (0.5, 1.0, 2.0):
        p = processed_probs(LOGITS[None], tensors(1, temperature=t))[0]
        torch.testing.assert_close(p, softmax(LOGITS, t))


def test_top_k_keeps_exactly_k():
    for k in (1, 3, 5):
        p = processed_probs(LOGITS[None], tensors(1, top_k=k))[0]
        assert (p > 0).sum() == k and (p[:k] > 0).all()
        torch.testing.assert_close(p[:k], softmax(LOGITS[:k]))


def test_top_p_keeps_smallest_nucleus():
    full = softmax(LOGITS)
    cum = full.cumsum(0)
    for top_p in (0.1, 0.5, 0.8, 0.95, 0.999):
        p = processed_probs(LOGITS[None], tensors(1, top_p=top_p))[0]
        kept = int((p > 0).sum())
        # smallest prefix reaching top_p: the prefix one shorter does not reach it
        expected = int((cum < top_p).sum()) + 1
        assert kept == expected, (top_p, kept, expected)
        torch.testing.assert_close(p[:kept], full[:kept] / full[:kept].sum())


def test_min_p_drops_tokens_below_fraction_of_max():
    full = softmax(LOGITS)
    for min_p in (0.05, 0.2, 0.6):
        p = processed_probs(LOGITS[None], tensors(1, min_p=min_p))[0]
        keep = full >= min_p * full.max()
        assert torch.equal(p > 0, keep)
        torch.testing.assert_close(p[keep], full[keep] / full[keep].sum())


def test_top_k_then_top_p_combined():
    p = processed_probs(LOGITS[None], tensors(1, top_k=4, top_p=0.7))[0]
    k4 = softmax(LOGITS[:4])
    expected = int((k4.cumsum(0) < 0.7).sum()) + 1
    assert int((p > 0).sum()) == expected


def test_greedy_rows_give_argmax_in_mixed_batch():
    torch.manual_seed(0)
    logits = torch.randn(6, 1000) * 3
    st = tensors(6, temperature=1.0, seed=11)
    st.temperature[::2] = 0.0            # rows 0, 2, 4 greedy; the batch is not all greedy
    for pos in range(20):
        out = sample(logits, st, torch.full((6,), pos))
        assert torch.equal(out[::2], logits[::2].argmax(-1))
    all_greedy = sample(logits, tensors(6, temperature=0.0), torch.zeros(6, dtype=torch.int64))
    assert torch.equal(all_greedy, logits.argmax(-1))


# -- empirical distribution of sample() ------------------------------------------------------------

N_DRAWS = 40000


def draws(st_kwargs, logits=LOGITS, seed=1234) -> torch.Tensor:
    st = tensors(N_DRAWS, seed=seed, **st_kwargs)
    out = sample(logits.expand(N_DRAWS, -1), st, torch.arange(N_DRAWS))   # a new position per draw
    return torch.bincount(out, minlength=logits.numel())


@pytest.mark.parametrize("kw", [dict(temperature=1.0), dict(temperature=0.7), dict(temperature=1.6),
                                dict(temperature=1.0, top_k=3), dict(temperature=0.9, top_p=0.8),
                                dict(temperature=1.0, min_p=0.1)], ids=str)
def test_sample_distribution_matches_processed_probs(kw):
    counts = draws(kw)
    target = processed_probs(LOGITS[None], tensors(1, **kw))[0]
    assert counts[target == 0].sum() == 0, "a filtered-out token was drawn"
    ok, stat = chi2_ok(counts, target)
    assert ok, (kw, stat, counts.tolist(), (target * N_DRAWS).round().tolist())
    if "top_k" not in kw and "top_p" not in kw and "min_p" not in kw:
        torch.testing.assert_close(target, softmax(LOGITS, kw["temperature"]))


def test_sample_detects_a_wrong_distribution():
    # the chi-square check has power: draws at T=1 do not fit softmax(logits / 1.3)
    ok, _ = chi2_ok(draws(dict(temperature=1.0)), softmax(LOGITS, 1.3))
    assert not ok


def test_sample_is_deterministic_per_seed_and_position():
    logits = torch.randn(1, 5000)
    st = tensors(1, temperature=1.0, seed=99)
    pos = torch.tensor([17])
    first = [int(sample(logits, st, pos)) for _ in range(3)]
    assert len(set(first)) == 1
    varied = {int(sample(logits, tensors(1, temperature=1.0, seed=s), pos)) for s in range(30)}
    assert len(varied) > 5


# -- SamplingParams --------------------------------------------------------------------------------


def test_sampling_params_defaults_and_stop_strings():
    p = SamplingParams()
    assert p.n == 1 and p.max_tokens == 16 and not p.greedy and p.stop_strings == ()
    assert SamplingParams(temperature=0.0).greedy
    assert SamplingParams(stop="x").stop_strings == ("x",)
    assert SamplingParams(stop=["a", "bc"]).stop_strings == ("a", "bc")


@pytest.mark.parametrize("kwargs,field", [
    (dict(temperature=-1.0), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.01), "top_p"),
    (dict(top_k=-5), "top_k"), (dict(min_p=-0.1), "min_p"), (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens="3"), "max_tokens"), (dict(n=0), "n"), (dict(seed=1.0), "seed"),
    (dict(stop=[""]), "stop"), (dict(stop_token_ids=[1, -2]), "stop_token_ids"),
    (dict(include_stop_str_in_output="no"), "include_stop_str_in_output"),
], ids=lambda x: str(x) if isinstance(x, dict) else x)
def test_sampling_params_validation_names_field(kwargs, field):
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    assert f"SamplingParams.{field}:" in str(info.value)
    assert repr(next(iter(kwargs.values()))) in str(info.value), "the message shows the bad value"


# -- logits processing (penalties, bias, bans) ---------------------------------------------------


def _reference_row(logits, prompt, generated, rep, presence, frequency):
    """One row processed from its explicit context: HF's repetition penalty over prompt and generated
    tokens, then OpenAI's frequency and presence penalties over generated tokens."""
    out = logits.clone()
    for t in set(prompt) | set(generated):
        out[t] = out[t] / rep if out[t] > 0 else out[t] * rep
    for t in set(generated):
        c = generated.count(t)
        out[t] -= frequency * c + presence
    return out


def test_penalties_see_each_rows_own_context():
    """Row j of a line counts the drafts before it; each line has its own parameters; rows past a
    line's real drafts count none of the dummy ones."""
    from pipespec.sampling import apply_penalties
    g = torch.Generator().manual_seed(0)
    vocab, k = 12, 3
    logits = torch.randn(3, k + 1, vocab, generator=g) * 2
    prompts = [[1, 2, 2], [3], [4, 5]]
    generated = [[2, 7, 7], [], [9]]
    drafts = torch.tensor([[7, 8, 2], [3, 3, 11], [5, 0, 0]])
    num_drafts = torch.tensor([3, 3, 1])
    params = [(1.5, 0.5, 0.25), (1.0, -1.0, 2.0), (0.7, 0.0, 0.0)]
    tokens = []
    for s in range(3):
        for t in sorted(set(prompts[s]) | set(generated[s])):
            tokens.append((s, t, generated[s].count(t), int(t in prompts[s])))
    out = apply_penalties(logits, drafts, num_drafts, torch.tensor(params), torch.tensor(tokens), None, None)
    for s in range(3):
        for j in range(k + 1):
            ctx = generated[s] + drafts[s, :min(j, int(num_drafts[s]))].tolist()
            want = _reference_row(logits[s, j], prompts[s], ctx, *params[s])
            torch.testing.assert_close(out[s, j], want, rtol=0, atol=1e-6)


def test_padded_tables_process_the_real_lines_bitwise_alike():
    """A CUDA graph's fixed-size tables (`padded_logits_tables`): the added lines and (line 0,
    token 0) entries change nothing, also where line 0's token 0 is a real entry (in the prompt,
    never generated) and a draft, and under a bias entry of its own."""
    from pipespec.sampling import apply_penalties, padded_logits_tables
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 3, 10, generator=g)
    drafts, num_drafts = torch.tensor([[0, 4], [0, 0]]), torch.tensor([2, 1])
    tables = (torch.tensor([[1.3, 0.4, 0.2], [0.8, -0.5, 0.3]]),
              torch.tensor([[0, 0, 0, 1], [0, 3, 1, 0], [1, 0, 0, 1], [1, 5, 4, 0]]),
              torch.tensor([[0, 0, 1, 3], [1, 2, 0, 1]]), torch.tensor([1.5, float("-inf")]))
    carried = torch.tensor([[2, -1], [7, 0]])
    want = apply_penalties(logits, drafts, num_drafts, *tables, carried=carried)
    padded = padded_logits_tables(*tables, lines=4, token_rows=16, bias_rows=8)
    assert [t.shape[0] for t in padded] == [4, 16, 8, 8] and padded[0][2:].tolist() == [[1.0, 0.0, 0.0]] * 2
    pad = lambda t: torch.cat((t, t.new_zeros(2, *t.shape[1:])))           # noqa: E731
    got = apply_penalties(pad(logits), pad(drafts), pad(num_drafts), *padded, carried=pad(carried))
    assert torch.equal(got[:2], want) and not torch.equal(want, logits)


@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_padded_sampling_verifies_the_real_lines_alike(top_p):
    """A CUDA graph's verification reads sampling tensors padded to its bucket
    (`SamplingTensors.padded`): the real lines draw and accept exactly as unpadded, the padding lines
    verify greedily."""
    from pipespec.sampling import SamplingTensors
    from pipespec.speculative.rejection import rejection_sample
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 4, 40, generator=g) * 3
    drafts = logits[:, :3].argmax(-1)               # drafts the target likes: some accepted
    drafts[1, 1] = (drafts[1, 1] + 1) % 40
    num_drafts, first = torch.tensor([3, 3, 2]), torch.tensor([5, 9, 17])
    st = SamplingTensors(torch.tensor([0.7, 0.0, 1.3]), torch.tensor([0, 0, 5]), torch.full((3,), top_p),
                         torch.tensor([0.0, 0.0, 0.05]), torch.tensor([11, 12, 13]), top_p < 1, False)
    want = rejection_sample(logits, drafts, num_drafts, st, first)
    padded = st.padded(8)
    assert [t.shape for t in padded.tensors()] == [(8,)] * 5 and (padded.needs_sort, padded.all_greedy) == (top_p < 1, False)
    assert padded.temperature[3:].eq(0).all() and padded.top_p[3:].eq(1).all() and torch.equal(padded.top_k[:3], st.top_k)
    pad = lambda t: torch.cat((t, t.new_zeros(5, *t.shape[1:])))           # noqa: E731
    tokens, num_sampled = rejection_sample(pad(logits), pad(drafts), pad(num_drafts), padded, pad(first))
    assert torch.equal(tokens[:3], want[0]) and torch.equal(num_sampled[:3], want[1])
    assert torch.equal(tokens[3:, 0], torch.zeros(5, 40).argmax(-1)) and num_sampled[3:].eq(1).all()


def test_neutral_penalties_leave_logits_bitwise():
    from pipespec.sampling import apply_penalties
    logits = torch.randn(2, 3, 50)
    out = apply_penalties(logits, torch.tensor([[1, 2], [3, 4]]), torch.tensor([2, 2]),
                          torch.tensor([[1.0, 0.0, 0.0]] * 2), torch.tensor([[0, 1, 3, 1], [1, 4, 1, 0]]), None, None)
    assert torch.equal(out, logits)


def test_bias_and_bans_apply_to_their_rows():
    from pipespec.sampling import apply_penalties
    logits = torch.zeros(2, 3, 10)
    entries = torch.tensor([[0, 4, 0, 3], [0, 5, 0, 1], [1, 6, 2, 3], [1, 6, 0, 3]])
    values = torch.tensor([2.5, float("-inf"), float("-inf"), -1.0])
    out = apply_penalties(logits, torch.zeros(2, 2, dtype=torch.int64), torch.zeros(2, dtype=torch.int64),
                          None, None, entries, values)
    assert out[0, :, 4].tolist() == [2.5] * 3
    assert out[0, :, 5].tolist() == [float("-inf"), 0.0, 0.0]
    assert out[1, :, 6].tolist() == [-1.0, -1.0, float("-inf")]
    assert out.isfinite().sum() == 2 * 3 * 10 - 2 and logits.eq(0).all()       # the input is untouched


def test_penalty_fields_validated():
    for bad in (dict(presence_penalty=2.5), dict(frequency_penalty="x"), dict(repetition_penalty=0),
                dict(logit_bias={-1: 1.0}), dict(logit_bias={3: 101}), dict(min_tokens=20, max_tokens=5),
                dict(bad_words=["ok", ""])):
        name = next(iter(bad))
        with pytest.raises(ValueError, match=name):
            SamplingParams(**bad)
    p = SamplingParams(presence_penalty=0.5)
    assert p.penalized and p.adjusts_logits and not SamplingParams().adjusts_logits
    assert SamplingParams(min_tokens=2).adjusts_logits and not SamplingParams(min_tokens=2).penalized


def test_sampled_with_penalties_under_a_draft_follows_sequential_sampling():
    """Chi-square: a line verifying one deterministic draft with presence/frequency/repetition
    penalties emits (token0[, token1]) as sampling one token at a time with penalties would: row 1
    counts the draft it follows, so a draft accepted in the same step is penalized after it."""
    from pipespec.sampling import apply_penalties
    from pipespec.speculative.rejection import rejection_sample
    n, vocab, draft = 40000, 6, 2
    row0 = torch.tensor([1.0, 0.5, 1.2, 0.0, -0.5, 0.3])
    row1 = torch.tensor([0.2, 0.9, 1.5, 0.4, 0.0, -1.0])        # the target's logits after the draft
    pen = (1.3, 0.4, 0.6)
    counts = [(0, 1, 2, 1), (0, 3, 0, 1)]                        # token 1 generated twice, 3 in the prompt
    logits = torch.stack((row0, row1))[None].expand(n, -1, -1).contiguous()
    lines = torch.arange(n)
    tokens_in = torch.tensor(counts).repeat(n, 1)
    tokens_in[:, 0] = lines.repeat_interleave(len(counts))
    processed = apply_penalties(logits, torch.full((n, 1), draft), torch.ones(n, dtype=torch.int64),
                                torch.tensor([pen]).expand(n, -1).contiguous(), tokens_in, None, None)
    st = tensors(n, temperature=0.8)
    st.seed = torch.arange(n, dtype=torch.int64) * 7919 + 3
    out, num = rejection_sample(processed, torch.full((n, 1), draft), torch.ones(n, dtype=torch.int64), st,
                                torch.full((n,), 10, dtype=torch.int64))

    def ref(row, generated, prompt):
        return (_reference_row(row, prompt, generated, *pen) / 0.8).softmax(-1)
    p0 = ref(row0, [1, 1], [3])
    p1 = ref(row1, [1, 1, draft], [3])
    outcome = torch.where(num == 1, out[:, 0], vocab + out[:, 1])       # x alone, or (draft, y) as vocab + y
    assert ((num == 1) | (out[:, 0] == draft)).all()
    probs = torch.cat((p0 * (torch.arange(vocab) != draft), p0[draft] * p1))
    ok, stat = chi2_ok(torch.bincount(outcome, minlength=2 * vocab).float(), probs)
    assert ok, stat
    # without the draft counted at row 1 the distribution is measurably another one
    wrong = torch.cat((p0 * (torch.arange(vocab) != draft), p0[draft] * ref(row1, [1, 1], [3])))
    assert not chi2_ok(torch.bincount(outcome, minlength=2 * vocab).float(), wrong)[0]
