"""The one-kernel fill-in of carried lines against `stage.carry.carry_in` (PyTorch): random steps of
prefill chunks and decode lines, some carried with drafts and shifts, K = 0..3, with and without
linear-attention commits; equal tensors. On a GPU; on CPU under the Triton interpreter."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from pipespec.stage.carry import Carry, carry_in
from pipespec.stage.step_input import StepInput
from tests.kernels import DEVICE, ON_KERNELS

pytestmark = ON_KERNELS

BS, W, N = 4, 9, 16


def _step(k: int, seed: int, commits: bool):
    g = torch.Generator().manual_seed(seed)
    r = lambda lo, hi, n=(): torch.randint(lo, hi, n, generator=g)       # noqa: E731
    num_reqs = int(r(1, 9))
    lens, real, carried = [], [], []
    for _ in range(num_reqs):
        if k and bool(r(0, 2)):                            # a decode line of 1 + k rows
            lens.append(k + 1)
            real.append(int(r(0, k + 1)))
        else:                                              # a prefill chunk or a plain decode
            lens.append(int(r(1, 6)))
            real.append(0)
        carried.append(int(r(0, N)) if bool(r(0, 3)) else -1)
    qsl = torch.tensor([0] + lens).cumsum(0)
    t = int(qsl[-1])
    start = r(0, 12, (num_reqs,))
    positions = torch.cat([torch.arange(s, s + n) for s, n in zip(start.tolist(), lens)])
    tables = torch.randperm(200, generator=g)[:num_reqs * W].view(num_reqs, W)
    line = torch.repeat_interleave(torch.arange(num_reqs), torch.tensor(lens))
    slots = tables[line, positions // BS] * BS + positions % BS
    i64 = lambda n: torch.zeros(n, dtype=torch.int64)      # noqa: E731  (fields carry_in does not read)
    inp = StepInput(
        num_spec_tokens=k, max_query_len=max(lens), padded=False, input_ids=r(0, 1000, (t,)), positions=positions,
        slot_mapping=slots, mtp_input_ids=r(0, 1000, (t,)), row_reqs=line, seq_lens=start + torch.tensor(lens),
        num_draft_rows=torch.tensor(real), num_drafts=torch.tensor(real), state_slots=i64(num_reqs),
        state_commit=r(-1, 3, (num_reqs,)) if commits else torch.full((num_reqs,), -1),
        carried=torch.tensor(carried), query_start_loc=qsl, block_tables=tables, sampling_reqs=i64(0),
        line_drafts=i64(0), verify_rows=i64((0, k + 1)))
    carry = Carry(tokens=r(1000, 2000, (N,)), drafts=r(2000, 3000, (N, k)), shift=r(0, k + 1, (N,)),
                  commit=r(-1, k + 1, (N,)) if commits else torch.full((N,), -1), sampled=r(0, 1000, (N, k + 1)))
    return inp, carry


@pytest.mark.parametrize("k", [0, 1, 2, 3])
@pytest.mark.parametrize("commits", [False, True])
def test_kernel_equals_the_pytorch_fill_in(k, commits):
    from pipespec.kernels.carry_in import carry_in_rows
    names = ("input_ids", "positions", "slot_mapping", "seq_lens", "mtp_input_ids", "state_commit")
    changed = dict.fromkeys(names, 0)
    for seed in range(12):
        inp, carry = _step(k, seed, commits)
        want = dataclasses.replace(inp, **{n: getattr(inp, n).clone() for n in names})
        carry_in(want, carry, BS)
        got = {f.name: getattr(inp, f.name) for f in dataclasses.fields(inp)}
        got = {n: v.clone().to(DEVICE) if isinstance(v, torch.Tensor) else v for n, v in got.items()}
        carry_in_rows(*(got[n] for n in ("input_ids", "positions", "slot_mapping", "mtp_input_ids", "seq_lens",
                                         "state_commit", "row_reqs", "query_start_loc", "carried", "num_drafts",
                                         "block_tables")),
                      *(getattr(carry, f.name).to(DEVICE) for f in dataclasses.fields(carry)), BS)
        for n in names:
            assert torch.equal(got[n].cpu(), getattr(want, n)), (n, k, seed)
            changed[n] += int((getattr(want, n) != getattr(inp, n)).sum())
    # the cases exercise every part: ids filled in, and with drafts lines moved and drafter ids
    assert changed["input_ids"] > 0 and (changed["state_commit"] > 0) == commits
    assert all(changed[n] > 0 for n in ("positions", "slot_mapping", "seq_lens", "mtp_input_ids")) == (k > 0), changed
