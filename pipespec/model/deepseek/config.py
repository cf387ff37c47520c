"""What DeepSeek-V3 (and GLM-4.5's MoE) read from config.json beyond `ArchConfig`."""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class YaRN:
    factor: float
    original_max_position: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None
    truncate: bool = True


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int
    top_k: int
    intermediate_size: int           # per routed expert
    num_shared: int                  # shared experts, run as one MLP of num_shared * intermediate_size
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    first_dense: int                 # layers [0, first_dense) use a dense MLP


@dataclass(frozen=True)
class IndexConfig:
    n_heads: int
    head_dim: int
    topk: int
    interleaved: bool = False            # the indexer's rope layout: GLM-5 interleaves, V3.2 does not
    shared: tuple[int, ...] = ()         # layers reusing the previous full layer's selection (GLM-5)


@dataclass(frozen=True)
class DeepSeekConfig:
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool
    rope_theta: float
    yarn: YaRN | None
    attention_bias: bool
    moe: MoEConfig
    index: "IndexConfig | None" = None      # DeepSeek sparse attention (V3.2)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        # YaRN: DeepSeek folds mscale_all_dim into the softmax scale, squared (once per q, once per k)
        scale = self.qk_head_dim ** -0.5
        if self.yarn is not None and self.yarn.mscale_all_dim:
            scale *= yarn_mscale(self.yarn.factor, self.yarn.mscale_all_dim) ** 2
        return scale


def rope_dict(cfg: dict) -> dict:
    """transformers 5.x `rope_parameters` merged with the 4.x `rope_scaling` (the original configs)."""
    rope = dict(cfg.get("rope_parameters") or {})
    rope.update(cfg.get("rope_scaling") or {})
    return rope


def parse_yarn(cfg: dict) -> YaRN | None:
    rope = rope_dict(cfg)
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind in (None, "default"):
        return None
    if kind != "yarn":
        raise ValueError(f"unsupported rope type {kind!r} for {cfg.get('model_type')}; pipespec supports yarn")
    orig = int(rope["original_max_position_embeddings"])
    factor = rope.get("factor") or cfg["max_position_embeddings"] / orig
    return YaRN(float(factor), orig, float(rope.get("beta_fast") or 32), float(rope.get("beta_slow") or 1),
                float(rope.get("mscale") or 0), float(rope.get("mscale_all_dim") or 0),
                rope.get("attention_factor"), bool(rope.get("truncate", True)))


def rope_theta(cfg: dict) -> float:
    return float(cfg.get("rope_theta", rope_dict(cfg).get("rope_theta", 10000.0)))


def _first_dense(cfg: dict) -> int:
    first = int(cfg.get("first_k_dense_replace") or 0)
    kinds = cfg.get("mlp_layer_types")          # DeepSeek-V3.2 spells it per layer
    if kinds is not None:
        first = kinds.count("dense")
        if kinds != ["dense"] * first + ["sparse"] * (len(kinds) - first):
            raise ValueError(f"unsupported mlp_layer_types {kinds}; pipespec supports dense layers first")
    return first


def parse_moe(cfg: dict) -> MoEConfig:
    scoring = cfg.get("scoring_func", "sigmoid")
    if scoring != "sigmoid":
        raise ValueError(f"unsupported MoE scoring_func {scoring!r}; pipespec supports sigmoid (DeepSeek-V3)")
    n_experts = cfg.get("n_routed_experts") or cfg.get("num_local_experts")
    return MoEConfig(num_experts=int(n_experts), top_k=int(cfg["num_experts_per_tok"]),
                     intermediate_size=int(cfg["moe_intermediate_size"]),
                     num_shared=int(cfg.get("n_shared_experts") or 0), n_group=int(cfg.get("n_group") or 1),
                     topk_group=int(cfg.get("topk_group") or 1), norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
                     routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
                     first_dense=_first_dense(cfg))


def _indexer_types(cfg: dict) -> list[str]:
    """GLM-5's per-layer "full" / "shared"; written out by transformers, else from the pattern keys."""
    if cfg.get("indexer_types"):
        return list(cfg["indexer_types"])
    n = int(cfg["num_hidden_layers"])
    pattern = cfg.get("index_topk_pattern")
    if pattern is not None:
        return [{"F": "full", "S": "shared"}[c] for c in pattern] if isinstance(pattern, str) else list(pattern)
    freq, offset = max(int(cfg.get("index_topk_freq", 1)), 1), int(cfg.get("index_skip_topk_offset", 2))
    return ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n)]


# every layer sparse, with its indexer: transformers 5.24 writes the first name, 5.17 the second
_SPARSE = ("indexed_attention", "deepseek_sparse_attention")


def parse_index(cfg: dict) -> IndexConfig | None:
    model_type = cfg.get("model_type")
    if model_type not in ("deepseek_v32", "glm_moe_dsa"):
        return None
    kinds = set(cfg.get("layer_types") or [_SPARSE[0]])
    if not kinds <= set(_SPARSE):
        raise ValueError(f"unsupported layer_types {sorted(kinds)}; pipespec supports {' / '.join(_SPARSE)} "
                         "(every layer with the indexer)")
    shared = ()
    if model_type == "glm_moe_dsa":
        shared = tuple(i for i, kind in enumerate(_indexer_types(cfg)) if kind == "shared")
        if 0 in shared:
            raise ValueError("indexer_types: layer 0 cannot reuse an earlier layer's selection")
    return IndexConfig(int(cfg["index_n_heads"]), int(cfg["index_head_dim"]), int(cfg["index_topk"]),
                       interleaved=model_type == "glm_moe_dsa", shared=shared)


def parse_deepseek(cfg: dict) -> DeepSeekConfig:
    return DeepSeekConfig(q_lora_rank=cfg.get("q_lora_rank"), kv_lora_rank=int(cfg["kv_lora_rank"]),
                          qk_nope_head_dim=int(cfg["qk_nope_head_dim"]), qk_rope_head_dim=int(cfg["qk_rope_head_dim"]),
                          v_head_dim=int(cfg["v_head_dim"]), rope_interleave=bool(cfg.get("rope_interleave", True)),
                          rope_theta=rope_theta(cfg), yarn=parse_yarn(cfg),
                          attention_bias=bool(cfg.get("attention_bias", False)), moe=parse_moe(cfg),
                          index=parse_index(cfg))
