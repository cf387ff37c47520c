"""DeepSeek-V3 target slice: MLA attention and, from layer `first_k_dense_replace` on, MoE.

Same contract as `LlamaForCausalLM` (see model/registry.py): one pipeline stage's layers, global
layer indices in parameter names, so each stage loads exactly its tensors. With tensor parallelism
(`tp`) the attention heads, the dense MLPs' and shared experts' intermediate size, the routed experts
and the vocabulary are split over the TP group (mla.py, moe.py, tp_layers.py).
"""
from __future__ import annotations

import torch
from torch import nn

from pipespec.model.arch import ArchConfig
from pipespec.model.attention import CacheShape, ForwardContext
from pipespec.model.deepseek.config import DeepSeekConfig, MoEConfig, parse_deepseek
from pipespec.model.deepseek.dsa import Selection
from pipespec.model.deepseek.mla import MLAttention
from pipespec.model.deepseek.moe import MoE
from pipespec.model.deepseek.rope import SliceRope
from pipespec.model.layers import GatedMLP, RMSNorm
from pipespec.model.slice import SliceModel, StageSlice, layer_span
from pipespec.model.tp_layers import SINGLE
from pipespec.model.weights import fused_parts
from pipespec.parallel import TensorParallel


def fused_names(module: nn.Module, prefix: str = "") -> dict[str, list[str]]:
    """Parameter name -> checkpoint tensors, for a module with fused qkv_proj / gate_up_proj and MoE."""
    names = {}
    for name in module.state_dict():
        full = prefix + name
        if not name.endswith(("experts_gate_up", "experts_down")):
            names[full] = fused_parts(full)
    for mname, m in module.named_modules():
        if isinstance(m, MoE):
            names.update(m.checkpoint_names(f"{prefix}{mname}."))
    return names


class DecoderLayer(nn.Module):
    """Pre-norm block: `attention` (MLA here, GQA for GLM-4.5), then a dense MLP for the first
    `first_k_dense_replace` layers and MoE after."""

    def __init__(self, arch: ArchConfig, moe: MoEConfig, index: int, attention: nn.Module,
                 tp: TensorParallel = SINGLE):
        super().__init__()
        h, eps = arch.hidden_size, arch.rms_norm_eps
        self.input_layernorm = RMSNorm(h, eps)
        self.self_attn = attention
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.mlp = GatedMLP(h, arch.intermediate_size, tp) if index < moe.first_dense else MoE(h, moe, tp)

    def forward(self, hidden, residual, rope, cache, ctx, selection=None):
        """`selection`: this forward call's sparse-attention selection (GLM-5 shared layers)."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        if selection is None:
            hidden = self.self_attn(hidden, rope, cache, ctx)
        else:
            hidden = self.self_attn(hidden, rope, cache, ctx, selection)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


def make_rope(cfg: DeepSeekConfig, max_position: int) -> SliceRope:
    return SliceRope(cfg.qk_rope_head_dim, cfg.rope_theta, max_position, cfg.yarn, cfg.rope_interleave)


def make_layer(arch: ArchConfig, cfg: DeepSeekConfig, index: int, tp: TensorParallel = SINGLE) -> DecoderLayer:
    shared = cfg.index is not None and index in cfg.index.shared
    attention = MLAttention(arch.hidden_size, arch.num_heads, cfg, arch.rms_norm_eps, reuses_selection=shared, tp=tp)
    return DecoderLayer(arch, cfg.moe, index, attention, tp)


class DeepseekV3ForCausalLM(StageSlice):
    """One stage of DeepSeek-V3; a family with another attention overrides `parse`, `make_layer`
    and `make_rope` (GLM-4.5)."""

    parse = staticmethod(parse_deepseek)
    make_layer = staticmethod(make_layer)
    make_rope = staticmethod(make_rope)

    def __init__(self, arch: ArchConfig, layer_range: tuple[int, int] | None = None,
                 max_position: int | None = None, tp: TensorParallel = SINGLE):
        super().__init__()
        start, end = layer_span(arch, layer_range)
        self.arch, self.tp = arch, tp
        self.cfg = self.parse(arch.hf_config)
        index = getattr(self.cfg, "index", None)
        if index is not None and start in index.shared:
            # its full layer runs on an earlier stage, and selections do not cross stages (yet)
            raise ValueError(f"pipeline stage starting at layer {start} would need the sparse-attention selection "
                             f"of an earlier stage (indexer_types: layer {start} is 'shared'); choose a "
                             "pipeline size whose stages start at 'full' layers")
        self.model = SliceModel(arch, {i: self.make_layer(arch, self.cfg, i, tp) for i in range(start, end)},
                                self.make_rope(self.cfg, max_position or arch.max_position), tp=tp)
        self._init_head()

    @property
    def reference_attention_only(self) -> bool:
        """Sparse attention (V3.2, GLM-5) selects keys per row on the torch backend only; dense MLA
        also runs on the GPU's paged kernel."""
        return getattr(self.cfg, "index", None) is not None

    def cache_shapes(self) -> list[CacheShape]:
        return [layer.self_attn.cache_shape() for layer in self.model.layers.values()]

    def checkpoint_names(self) -> dict[str, list[str]]:
        return self._tie_head(fused_names(self))

    def forward(self, ctx: ForwardContext, input_ids: torch.Tensor | None = None,
                hidden: torch.Tensor | None = None, residual: torch.Tensor | None = None):
        hidden, residual = self._embed(input_ids, hidden, residual)
        rope = self.model.rotary(ctx.positions)
        selection = Selection() if getattr(self.cfg, "index", None) is not None else None   # this call's alone
        for local, layer in enumerate(self.model.layers.values()):
            hidden, residual = layer(hidden, residual, rope, ctx.kv_caches[local], ctx, selection)
        return self._finish(hidden, residual)
