"""The one-kernel fill-in of carried lines against `layout.carry_in` (PyTorch): random steps of
prefill chunks and decode lines, some carried with drafts and shifts, K = 0..3, with and without
linear-attention commits; equal tensors. On a GPU; on CPU under the Triton interpreter."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from pipespec.layout import Carry, StepLayout, carry_in
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
    layout = StepLayout(
        num_spec_tokens=k, input_ids=r(0, 1000, (t,)), positions=positions, slot_mapping=slots,
        query_start_loc=qsl, seq_lens=start + torch.tensor(lens), block_tables=tables, max_query_len=max(lens),
        sample_rows=torch.arange(num_reqs), verify_rows=torch.zeros(num_reqs, k + 1, dtype=torch.int64),
        num_drafts=torch.tensor(real), draft_ids=torch.zeros(num_reqs, k, dtype=torch.int64),
        mtp_input_ids=r(0, 1000, (t,)), state_commit=r(-1, 3, (num_reqs,)) if commits else None,
        req_real_drafts=torch.tensor(real), carried=torch.tensor(carried))
    carry = Carry(tokens=r(1000, 2000, (N,)), drafts=r(2000, 3000, (N, k)), shift=r(0, k + 1, (N,)),
                  commit=r(-1, k + 1, (N,)))
    return layout, carry, line


@pytest.mark.parametrize("k", [0, 1, 2, 3])
@pytest.mark.parametrize("commits", [False, True])
def test_kernel_equals_the_pytorch_fill_in(k, commits):
    from pipespec.kernels.carry_in import carry_in as carry_in_kernel
    names = ("input_ids", "positions", "slot_mapping", "seq_lens", "mtp_input_ids", "state_commit")
    changed = dict.fromkeys(names, 0)
    for seed in range(12):
        layout, carry, line = _step(k, seed, commits)
        want = dataclasses.replace(layout, **{n: getattr(layout, n).clone() for n in names
                                              if getattr(layout, n) is not None})
        carry_in(want, carry, line, BS)
        on = lambda x: x.clone().to(DEVICE) if isinstance(x, torch.Tensor) else x       # noqa: E731
        got = dataclasses.replace(layout, **{f.name: on(getattr(layout, f.name)) for f in dataclasses.fields(layout)})
        carry_in_kernel(got, Carry(*(on(getattr(carry, f.name)) for f in dataclasses.fields(carry))),
                        line.to(DEVICE), BS)
        for n in names:
            if getattr(want, n) is not None:
                assert torch.equal(getattr(got, n).cpu(), getattr(want, n)), (n, k, seed)
                changed[n] += int((getattr(want, n) != getattr(layout, n)).sum())
    # the cases exercise every part: ids filled in, and with drafts lines moved and drafter ids
    assert changed["input_ids"] > 0 and (changed["state_commit"] > 0) == commits
    assert all(changed[n] > 0 for n in ("positions", "slot_mapping", "seq_lens", "mtp_input_ids")) == (k > 0), changed
