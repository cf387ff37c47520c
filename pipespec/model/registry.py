"""Which module builds a stage's slice of the target, by the checkpoint's `model_type`.

A family adds one line here. Its module takes (arch, layer_range, max_position) and offers what the
stage uses of a target slice (see `LlamaForCausalLM`): `forward(ctx, input_ids | hidden, residual)`,
`compute_logits`, `head_weight`, `checkpoint_names`, `num_local_layers` and `model.is_first/is_last`.
"""
from __future__ import annotations

from typing import Callable

from torch import nn

from pipespec.model.arch import ArchConfig
from pipespec.model.deepseek.model import DeepseekV3ForCausalLM
from pipespec.model.glm4_moe import Glm4MoeForCausalLM
from pipespec.model.llama import LlamaForCausalLM
from pipespec.model.qwen3_next import Qwen3NextForCausalLM
from pipespec.model.tp_layers import SINGLE
from pipespec.parallel import TensorParallel

TARGETS: dict[str, Callable[..., nn.Module]] = {
    "llama": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM,
    "mimo": LlamaForCausalLM,       # a Qwen2 decoder (its MTP layers are the drafter's)
    "deepseek_v3": DeepseekV3ForCausalLM,
    "deepseek_v32": DeepseekV3ForCausalLM,   # + sparse attention (the config's index_* keys)
    "glm_moe_dsa": DeepseekV3ForCausalLM,    # GLM-5: V3.2's layout, interleaved indexer rope, shared layers
    "glm4_moe": Glm4MoeForCausalLM,
    "qwen3_next": Qwen3NextForCausalLM,     # hybrid: Gated DeltaNet + gated attention, MoE
    "qwen3_5": Qwen3NextForCausalLM,        # Qwen3.5 / 3.6 dense (vision tower skipped)
    "qwen3_5_moe": Qwen3NextForCausalLM,    # Qwen3.5 / 3.6 MoE
}


def build_target(arch: ArchConfig, layer_range: tuple[int, int], max_position: int,
                 tp: TensorParallel = SINGLE) -> nn.Module:
    try:
        family = TARGETS[arch.model_type]
    except KeyError:
        raise ValueError(f"unsupported model_type {arch.model_type!r}; pipespec supports "
                         f"{', '.join(sorted(TARGETS))}") from None
    return family(arch, layer_range, max_position=max_position, tp=tp)      # every family splits over TP
