"""Routed experts for a few (token, slot) pairs, as two GEMV kernels with no sort.

At decode the grouped GEMMs of `model/routed_experts.py` read each selected expert's weights once
but reach well under half the memory bandwidth at one row per expert, and the sort, counts, gathers and
scatter around them are another eight small kernels a layer. With few pairs every pair can read
its expert's rows itself: kernel 1 computes h[p] = silu(gate . x) * (up . x) for pair p = (t, j)
and a tile of intermediate columns; kernel 2 computes, for token t and a tile of hidden columns,
the k slots' down . h[p] at once and sums them with the routing weights in registers (a fixed
order: deterministic, and no [T*k, H] buffer). Every shape comes from the host, so a step captures
in a CUDA graph. A pair routed to another rank's expert (id - first outside [0, E)) masks off its
weight loads: it reads nothing and adds zero.

A shared expert shaped like a routed one (DeepSeek-V3's, GLM's) can ride along as one more pair a
token (`shared`), so the MoE layer's shared MLP launches nothing of its own.

FP8 experts (block-scaled e4m3, `model/quant/experts.py`) are dequantized as the tiles are read;
int4 experts (AWQ / GPTQ, whose layout runs along the outputs) have kernels of their own that read
32 output columns a program and unpack the nibbles in registers.

Rounding follows the grouped-GEMM path at x's dtype: gate and up are rounded, silu(gate) is, and
so is their product (the down GEMM's input), and each slot's down output before it is weighed.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pipespec.kernels import cdiv, next_pow2
from pipespec.kernels.launch import cached_launch
from pipespec.kernels.pdl import pdl_args, pdl_signal, pdl_wait
from pipespec.kernels.quant_matmul import unpack_int4


@triton.jit
def _weights(ptr, s_ptr, rows, k, mask, H: tl.constexpr, FP8: tl.constexpr, BO: tl.constexpr, BI: tl.constexpr):
    """A tile of stacked expert rows [rows, k] (row length H) in float32: as stored, or FP8 e4m3
    times its block scale (row // BO, k // BI)."""
    w = tl.load(ptr + rows * H + k, mask=mask, other=0.0).to(tl.float32)
    if FP8:
        w *= tl.load(s_ptr + (rows // BO) * ((H + BI - 1) // BI) + k // BI, mask=mask, other=0.0)
    return w


@triton.jit
def silu_mul(gate, up, h_ptr):
    """silu(gate) * up in h_ptr's element type, rounded as the grouped-GEMM path rounds it: gate, up,
    silu(gate) and the product each at that type (float32 accumulators in)."""
    dt = h_ptr.dtype.element_ty
    g = gate.to(dt).to(tl.float32)
    u = up.to(dt).to(tl.float32)
    silu = (g * tl.sigmoid(g)).to(dt).to(tl.float32)
    return (silu * u).to(dt)


@triton.jit
def _local_expert(ids_ptr, pair, first, E):
    """(this rank's index of the pair's expert, clamped to 0 for another rank's; whether it is ours),
    int64: offsets into a large stack pass 2**31."""
    e = (tl.load(ids_ptr + pair) - first).to(tl.int64)
    mine = (e >= 0) & (e < E)
    return tl.where(mine, e, 0), mine


@cached_launch
@triton.jit
def _gate_up_kernel(x_ptr, ids_ptr, gu_ptr, gs_ptr, sgu_ptr, h_ptr, first, E, stride_x, routed_pairs,
                    K: tl.constexpr, H: tl.constexpr, I: tl.constexpr, FP8: tl.constexpr, BO: tl.constexpr,
                    BI: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SHARED: tl.constexpr,
                    PDL: tl.constexpr):
    pdl_signal(PDL)
    pdl_wait(PDL)
    p = tl.program_id(0)                    # pairs vary fastest: pairs sharing an expert read its
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)    # tile at once, mostly from L2
    rk = tl.arange(0, BLOCK_K)
    token = p // K
    if SHARED:                              # pairs past the routed ones: each token's shared expert
        routed = p < routed_pairs
        e, mine = _local_expert(ids_ptr, tl.minimum(p, routed_pairs - 1), first, E)
        e, mine = tl.where(routed, e, 0), mine | (p >= routed_pairs)
        token = tl.where(routed, token, p - routed_pairs)
        gu_ptr = tl.where(routed, gu_ptr, sgu_ptr)
    else:
        e, mine = _local_expert(ids_ptr, p, first, E)
    gate = e * (2 * I) + rn[:, None]                         # stacked rows: gate, then up
    row_ok = mine & (rn[:, None] < I)
    acc_g = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)   # reduced once, after the loop
    acc_u = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        k = k0 + rk
        xk = tl.load(x_ptr + token * stride_x + k, mask=k < H, other=0.0).to(tl.float32)
        ok = row_ok & (k[None, :] < H)
        g = _weights(gu_ptr, gs_ptr, gate, k[None, :], ok, H, FP8, BO, BI)
        u = _weights(gu_ptr, gs_ptr, gate + I, k[None, :], ok, H, FP8, BO, BI)
        acc_g += g * xk[None, :]
        acc_u += u * xk[None, :]
    tl.store(h_ptr + p * I + rn, silu_mul(tl.sum(acc_g, 1), tl.sum(acc_u, 1), h_ptr), mask=rn < I)


@cached_launch
@triton.jit
def _down_kernel(h_ptr, ids_ptr, w_ptr, down_ptr, ds_ptr, sdown_ptr, y_ptr, add_ptr, first, E, routed_pairs,
                 K: tl.constexpr, H: tl.constexpr, I: tl.constexpr, FP8: tl.constexpr, BO: tl.constexpr,
                 BI: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 ADD: tl.constexpr, SHARED: tl.constexpr, PDL: tl.constexpr):
    pdl_signal(PDL)
    pdl_wait(PDL)
    t = tl.program_id(0)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rs = tl.arange(0, BLOCK_S)              # the token's k slots, one tile: their loads overlap
    rk = tl.arange(0, BLOCK_K)
    pair = t * K + rs
    e = (tl.load(ids_ptr + pair, mask=rs < K, other=0) - first).to(tl.int64)
    mine = (rs < K) & (e >= 0) & (e < E)
    e = tl.where(mine, e, 0)
    rows = e[:, None, None] * H + rn[None, :, None]          # stacked rows of length I
    row_ok = mine[:, None, None] & (rn[None, :, None] < H)
    acc = tl.zeros((BLOCK_S, BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc_s = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)   # the shared expert's (SHARED)
    for k0 in range(0, I, BLOCK_K):
        k = k0 + rk
        h = tl.load(h_ptr + pair[:, None] * I + k[None, :], mask=(rs[:, None] < K) & (k[None, :] < I),
                    other=0.0).to(tl.float32)
        d = _weights(down_ptr, ds_ptr, rows, k[None, None, :], row_ok & (k[None, None, :] < I), I, FP8, BO, BI)
        acc += d * h[:, None, :]
        if SHARED:
            hs = tl.load(h_ptr + (routed_pairs + t) * I + k, mask=k < I, other=0.0).to(tl.float32)
            ds = tl.load(sdown_ptr + rn[:, None] * I + k[None, :], mask=(rn[:, None] < H) & (k[None, :] < I),
                         other=0.0).to(tl.float32)
            acc_s += ds * hs[None, :]
    dt = y_ptr.dtype.element_ty
    y = tl.sum(acc, 2).to(dt).to(tl.float32)                   # each slot's output, rounded
    w = tl.load(w_ptr + pair, mask=rs < K, other=0.0).to(tl.float32)
    y = tl.sum(y * w[:, None], 0).to(dt)
    # + the shared experts' output, rounded as the separate MLP and add it replaces round them
    if SHARED:
        y = (y.to(tl.float32) + tl.sum(acc_s, 1).to(dt).to(tl.float32)).to(dt)
    if ADD:
        y = (y.to(tl.float32) + tl.load(add_ptr + t * H + rn, mask=rn < H, other=0.0).to(tl.float32)).to(dt)
    tl.store(y_ptr + t * H + rn, y, mask=rn < H)


@triton.jit
def _int4_tile(q_ptr, z_ptr, s_ptr, e, k0, rw, cols, col_ok, K: tl.constexpr, N: tl.constexpr, GROUP: tl.constexpr,
               BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """Rows k0 .. k0 + BLOCK_K (inside one group) of expert e's int4 weight at `cols`, in float32
    [BLOCK_K, cols]: the `Int4Weight` layout, stacked per expert."""
    words = tl.load(q_ptr + (e * (K // 8) + k0 // 8 + rw[:, None]) * N + cols[None, :], mask=col_ok[None, :], other=0)
    q = unpack_int4(words, BLOCK_K, BLOCK_N)
    g = e * (K // GROUP) + k0 // GROUP
    z = tl.load(z_ptr + g * N + cols, mask=col_ok, other=0.0).to(tl.float32)
    s = tl.load(s_ptr + g * N + cols, mask=col_ok, other=0.0).to(tl.float32)
    return (q - z[None, :]) * s[None, :]


@cached_launch
@triton.jit
def _int4_gate_up_kernel(x_ptr, ids_ptr, q_ptr, z_ptr, s_ptr, h_ptr, first, E, stride_x,
                         K: tl.constexpr, H: tl.constexpr, I: tl.constexpr, GROUP: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """int4 experts (N = 2I columns: gate, then up): as `_gate_up_kernel`, columns contiguous."""
    p = tl.program_id(0)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rw = tl.arange(0, BLOCK_K // 8)
    e, mine = _local_expert(ids_ptr, p, first, E)
    ok = mine & (rn < I)
    acc_g = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        xk = tl.load(x_ptr + (p // K) * stride_x + k0 + tl.arange(0, BLOCK_K)).to(tl.float32)[:, None]
        acc_g += tl.sum(_int4_tile(q_ptr, z_ptr, s_ptr, e, k0, rw, rn, ok, H, 2 * I, GROUP, BLOCK_K, BLOCK_N) * xk, 0)
        acc_u += tl.sum(_int4_tile(q_ptr, z_ptr, s_ptr, e, k0, rw, I + rn, ok, H, 2 * I, GROUP, BLOCK_K, BLOCK_N) * xk,
                        0)
    tl.store(h_ptr + p * I + rn, silu_mul(acc_g, acc_u, h_ptr), mask=rn < I)


@cached_launch
@triton.jit
def _int4_down_kernel(h_ptr, ids_ptr, w_ptr, q_ptr, z_ptr, s_ptr, y_ptr, first, E,
                      H: tl.constexpr, I: tl.constexpr, GROUP: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """int4 experts' down product of one pair, rounded as the grouped path rounds it and weighed:
    a float32 row per pair (the caller sums a token's slots in order), so a token's K slots run as
    K programs, which keeps the GPU busy at one token."""
    pair = tl.program_id(0)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rw = tl.arange(0, BLOCK_K // 8)
    e, mine = _local_expert(ids_ptr, pair, first, E)
    ok = mine & (rn < H)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        hk = tl.load(h_ptr + pair * I + k0 + tl.arange(0, BLOCK_K)).to(tl.float32)[:, None]
        acc += tl.sum(_int4_tile(q_ptr, z_ptr, s_ptr, e, k0, rw, rn, ok, I, H, GROUP, BLOCK_K, BLOCK_N) * hk, 0)
    y = acc.to(h_ptr.dtype.element_ty).to(tl.float32) * tl.load(w_ptr + pair).to(tl.float32)
    tl.store(y_ptr + pair * H + rn, y, mask=rn < H)


def few_pair_int4_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up, down,
                          first: int | None = None) -> torch.Tensor:
    """`few_pair_experts` for int4 stacks (`model/quant/experts.py::Int4Stack`: qweight [E, K / 8, N],
    zeros and scales [E, K / group, N], N the outputs: 2I for gate and up, H for down)."""
    t, k = ids.shape
    e, h_dim, i_dim = gate_up.qweight.shape[0], x.shape[-1], down.qweight.shape[1] * 8
    x = x.contiguous()
    out = torch.empty_like(x)
    if t == 0:
        return out
    group = gate_up.group
    if down.group != group or h_dim % group or i_dim % group or group % 8:
        raise ValueError(f"int4 experts need one group size dividing H = {h_dim} and I = {i_dim}")
    ids, weights = ids.contiguous(), weights.contiguous()
    hid = torch.empty(t * k, i_dim, dtype=x.dtype, device=x.device)
    block_k = min(64, group & -group)                # a step inside one group
    # 32 outputs a program: a word row is 128 bytes, and at one token the k * I / 32 and k * H / 32
    # programs fill the GPU
    _int4_gate_up_kernel[(t * k, cdiv(i_dim, 32))](
        x, ids, gate_up.qweight, gate_up.zeros, gate_up.scales, hid, first or 0, e, x.stride(0), K=k, H=h_dim,
        I=i_dim, GROUP=group, BLOCK_N=32, BLOCK_K=block_k, num_warps=2)
    per_pair = torch.empty(t * k, h_dim, dtype=torch.float32, device=x.device)
    _int4_down_kernel[(t * k, cdiv(h_dim, 32))](
        hid, ids, weights, down.qweight, down.zeros, down.scales, per_pair, first or 0, e, H=h_dim, I=i_dim,
        GROUP=group, BLOCK_N=32, BLOCK_K=block_k, num_warps=2)
    return per_pair.view(t, k, h_dim).sum(1).to(x.dtype)    # the slots in order: deterministic


@dataclass(frozen=True)
class FewPairShape:
    """Launch shapes of the two dense/FP8 kernels: output rows a program, the K elements a step
    (down: shared by the token's slots, each taking block_k / slots of it, at least 64), warps.
    Chosen by `benchmarks/moe_experts_gpu.py --sweep` at one token (GLM-4.7-Flash: 64 experts,
    top-4 and a shared one; Qwen3.5-35B-A3B: 256, top-8; RESULTS.md): 2 rows a program, 4 warps, so
    that at one token there are thousands of small programs (k * I / 2, H / 2) keeping loads in
    flight."""
    gate_up_n: int = 2
    gate_up_k: int = 1024
    gate_up_warps: int = 4
    down_n: int = 2
    down_k: int = 2048
    down_warps: int = 4


FEW_PAIR = FewPairShape()


def shared_fits(shared: tuple[torch.Tensor, torch.Tensor] | None, gate_up, down) -> bool:
    """Whether a shared expert (gate_up [2I, H], down [H, I], dense) runs as one more pair a token in
    `few_pair_experts` with dense routed stacks: the same I (not split by tensor parallelism), dtype
    and contiguous rows."""
    if shared is None or not isinstance(gate_up, torch.Tensor) or not isinstance(down, torch.Tensor):
        return False
    sgu, sdown = shared
    return (isinstance(sgu, torch.Tensor) and isinstance(sdown, torch.Tensor) and sgu.shape == gate_up.shape[1:]
            and sdown.shape == down.shape[1:] and sgu.dtype == gate_up.dtype == sdown.dtype
            and sgu.is_contiguous() and sdown.is_contiguous())


def few_pair_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up, down,
                     first: int | None = None, add: torch.Tensor | None = None,
                     shared: tuple[torch.Tensor, torch.Tensor] | None = None,
                     shape: FewPairShape = FEW_PAIR) -> torch.Tensor:
    """`routed_experts` (same arguments, same result) for few pairs: see the module docstring.
    `add` [T, H] (the shared experts' output) is added to the result by the second kernel; or
    `shared` = (gate_up [2I, H], down [H, I]) of a shared expert (`shared_fits`) runs inside both
    kernels as one more pair a token, weight 1, its output rounded and added as a separate MLP's
    would be: no launches of its own.
    gate_up, down: dense stacks [E, 2I, H], [E, H, I], or FP8 ones (`model/quant/experts.py::
    Fp8Stack`: e4m3 `weight` [E * 2I, H], [E * H, I] with block scales `scale_inv`), which the
    kernels dequantize as they read them."""
    t, k = ids.shape
    fp8 = hasattr(gate_up, "scale_inv")
    if fp8:
        gu, gs, dn, ds = gate_up.weight, gate_up.scale_inv, down.weight, down.scale_inv
        (bo, bi), h_dim, i_dim = gate_up.block, x.shape[-1], down.weight.shape[1]
        e = dn.shape[0] // h_dim
    else:
        gu, dn = gate_up, down
        gs, ds, bo, bi = gu, dn, 1, 1              # no scales: unused pointers
        e, h_dim, i_dim = down.shape
    x = x.contiguous()
    out = torch.empty_like(x)
    if t == 0:
        return out
    if not (gu.is_contiguous() and dn.is_contiguous()):    # a copy would cost every expert
        raise ValueError("few_pair_experts reads the expert stacks in place: they must be contiguous")
    if add is not None and (add.shape != x.shape or add.dtype != x.dtype):
        raise ValueError(f"few_pair_experts adds a [T, H] tensor of the input's dtype; got {tuple(add.shape)} "
                         f"{add.dtype}")
    if shared is not None and not shared_fits(shared, gate_up, down):
        raise ValueError("few_pair_experts runs a shared expert shaped like a routed one (dense, same I and dtype)")
    ids, weights = ids.contiguous(), weights.contiguous()
    pairs = t * k + (t if shared is not None else 0)
    hid = torch.empty(pairs, i_dim, dtype=x.dtype, device=x.device)
    first = first or 0
    sgu, sdown = shared if shared is not None else (gu, dn)     # no shared expert: unused pointers
    _gate_up_kernel[(pairs, cdiv(i_dim, shape.gate_up_n))](
        x, ids, gu, gs, sgu, hid, first, e, x.stride(0), t * k, K=k, H=h_dim, I=i_dim, FP8=fp8, BO=bo, BI=bi,
        BLOCK_N=shape.gate_up_n, BLOCK_K=min(shape.gate_up_k, next_pow2(h_dim)),
        SHARED=shared is not None, num_warps=shape.gate_up_warps, **pdl_args(x.device))
    bs = next_pow2(k)
    _down_kernel[(t, cdiv(h_dim, shape.down_n))](
        hid, ids, weights, dn, ds, sdown, out, out if add is None else add.contiguous(), first, e, t * k, K=k,
        H=h_dim, I=i_dim, FP8=fp8, BO=bo, BI=bi, BLOCK_S=bs, BLOCK_N=shape.down_n,
        BLOCK_K=min(max(64, shape.down_k // bs), next_pow2(i_dim)), ADD=add is not None,
        SHARED=shared is not None, num_warps=shape.down_warps, **pdl_args(x.device))
    return out
