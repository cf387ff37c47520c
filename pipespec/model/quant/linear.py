"""Linear layers that keep a quantized checkpoint's weights quantized on the GPU.

`use_quantized_linears` replaces each linear layer whose checkpoint tensors are all quantized (a
fused q/k/v or gate/up projection: all its parts) by a `QuantLinear` holding the packed weight, which
the kernels of `kernels/quant_matmul.py` multiply without ever writing the dense matrix. The rest of
the model (norms, embeddings, the LM head, routers, MoE experts, layers the config keeps in full
precision) loads dense as before. Where the kernels do not run (CPU, training), the dequantized
path of `QuantizedSource` serves instead, and this module is not used.

With tensor parallelism each rank keeps its shard of the packed tensors: a column-parallel layer
its output rows of each part (FP8: whole scale blocks), a row-parallel one its input columns (int4:
whole groups, and not under act-order, whose rows are permuted; FP8: whole blocks), all-reducing
after the product as the dense layer does. A layer that cannot be cut so loads dense (a log line
names it). Each rank reads the whole quantized tensors of its layers and keeps its part.
"""
from __future__ import annotations

import logging
import zlib

import torch
from torch import nn

from pipespec import kernels
from pipespec.model.linear import silu_mul
from pipespec.model.quant.packed import Fp8Weight, Int4Weight, concat
from pipespec.model.tp_layers import ColumnParallelLinear, RowParallelLinear, pairs

logger = logging.getLogger(__name__)

# the projections a module calls as layers (MLA's kv_b_proj is not: its weight is split per head and
# absorbed, so it stays dense)
_LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "q_proj", "k_proj", "v_proj", "gate_proj", "up_proj",
            "fused_qkv_a_proj", "q_b_proj", "kv_a_proj_with_mqa")


class QuantLinear(nn.Module):
    """y = x @ W.T (+ bias) with W packed (`Int4Weight` or `Fp8Weight`); the packed tensors are
    non-persistent buffers, so the dense loader neither asks the checkpoint for them nor for a
    `weight`."""

    def __init__(self, packed: Int4Weight | Fp8Weight, bias: nn.Parameter | None, replaces: nn.Module | None = None):
        """`replaces`: the dense layer it stands for; a row-parallel one's all-reduce and a column-
        parallel one's bias shard carry over."""
        super().__init__()
        self.packed = packed
        self.out_features, self.in_features = packed.shape
        self.bias = bias
        row = isinstance(replaces, RowParallelLinear) and replaces.tp.size > 1
        self.tp, self.reduce = (replaces.tp, replaces.reduce) if row else (None, True)
        self._bias_shard = ({"bias": replaces.checkpoint_shards()["bias"]}
                            if isinstance(replaces, ColumnParallelLinear) and bias is not None else {})
        for name, t in vars(packed).items():        # moved with the module by .to()
            if isinstance(t, torch.Tensor):
                self.register_buffer(f"packed_{name}", t, persistent=False)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        for name, t in vars(self.packed).items():    # keep the packed view on the moved buffers
            if isinstance(t, torch.Tensor):
                setattr(self.packed, name, getattr(self, f"packed_{name}"))
        return self

    def forward(self, x: torch.Tensor, gated: bool = False) -> torch.Tensor:
        """gated: x is a fused gate/up row, multiplied as silu(gate) * up (a down projection)."""
        if kernels.enabled(x):
            y = self.packed.matmul(x, gated)
        else:   # training or autograd: the dense product (slow; the engine serves with the kernel)
            x = silu_mul(x) if gated else x
            y = x @ self.packed.dequantize().to(x.device, x.dtype).t()
        if self.tp is not None:          # row-parallel: partial sums, bias after the reduce
            if not self.reduce:
                return y
            y = self.tp.all_reduce(y)
        return y if self.bias is None else y + self.bias

    def checkpoint_shards(self) -> dict:
        return self._bias_shard


def _linears(model: nn.Module):
    """(name, layer) of every attention or MLP projection, listed before any is replaced."""
    return [(name, m) for name, m in model.named_modules()
            if isinstance(m, nn.Linear) and name.rpartition(".")[2] in _LINEARS]


def _replace(model: nn.Module, name: str, packed: Int4Weight | Fp8Weight, dense: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, QuantLinear(packed, dense.bias, dense))


def use_quantized_linears(model: nn.Module, source, device: torch.device) -> int:
    """Replace the linear layers of `model` whose checkpoint tensors are all quantized in `source` (a
    `QuantizedSource`) by `QuantLinear`s on `device`; returns how many. Call before the dense load."""
    names = model.checkpoint_names()
    count, kept = 0, []
    for mname, module in _linears(model):
        parts = names.get(f"{mname}.weight", [])
        if not parts or not all(source.is_quantized(p) for p in parts):
            continue
        try:
            packed = concat([_shard(source.packed(p), module, i) for i, p in enumerate(parts)])
        except ValueError as e:
            kept.append(f"{mname} ({e})")
            continue
        if tuple(packed.shape) != tuple(module.weight.shape):
            raise ValueError(f"{mname}: quantized weight of shape {tuple(packed.shape)}, the model expects "
                             f"{tuple(module.weight.shape)}")
        _replace(model, mname, packed.to(device), module)
        count += 1
    if kept:
        logger.info("quantized layers served dense (dequantized): %s", "; ".join(kept[:3]))
    return count


def _shard(packed: Int4Weight | Fp8Weight, module: nn.Module, part: int) -> Int4Weight | Fp8Weight:
    """This rank's share of checkpoint part `part` of `module`'s weight."""
    if isinstance(module, ColumnParallelLinear):
        return concat([packed.rows(a, b) for a, b in pairs(module.ranges[part])])
    if isinstance(module, RowParallelLinear) and module.tp.size > 1:
        return packed.columns(module.start, module.start + module.in_features)
    return packed


@torch.no_grad()
def use_dummy_quantized_linears(model: nn.Module, method: str, device: torch.device, seed: int = 0) -> int:
    """`load_format="dummy"` with `quantization=method`: the same layers `use_quantized_linears` would
    keep quantized get random packed weights (int4: groups of up to 128 rows, zero 8, weights about
    N(0, 0.02) like the dense dummy; fp8: 128 x 128 scale blocks). Returns how many."""
    gen = torch.Generator(device=device)
    count = 0
    for mname, module in _linears(model):
        out, inp = module.weight.shape
        gen.manual_seed(seed * 1_000_003 + zlib.crc32(mname.encode()))
        if method == "fp8":
            w = torch.randn(out, inp, device=device, generator=gen).to(torch.float8_e4m3fn)
            packed = Fp8Weight(w, torch.full((-(-out // 128), -(-inp // 128)), 0.02, device=device), (128, 128))
        else:
            group = next((g for g in (128, 64, 32, 16) if inp % g == 0), None)
            if group is None:
                continue
            q = torch.randint(-2**31, 2**31 - 1, (inp // 8, out), device=device, generator=gen, dtype=torch.int32)
            full = torch.full((inp // group, out), 1.0, device=device, dtype=torch.float16)   # AWQ's dtype
            packed = Int4Weight(q, full * 8, full * 0.0045, group)      # (q - 8) * s: std ~0.02
        _replace(model, mname, packed, module)
        count += 1
    return count
