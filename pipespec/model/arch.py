"""Model architecture read from a checkpoint (HF config.json or GGUF metadata)."""
from __future__ import annotations

from dataclasses import dataclass, field

from pipespec.model.hybrid_config import HYBRID_MODEL_TYPES, NESTED_MODEL_TYPES, HybridConfig

# families that read their rope (YaRN, partial rotary) and the rest of their shape from `hf_config`
OWN_CONFIG_TYPES = ("deepseek_v3", "deepseek_v32", "glm4_moe", "glm_moe_dsa")
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mimo") + OWN_CONFIG_TYPES + HYBRID_MODEL_TYPES   # mimo: a Qwen2 decoder (+ MTP layers)


@dataclass(frozen=True)
class RopeScaling:
    kind: str                     # "llama3" or "linear"
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


@dataclass(frozen=True)
class ArchConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    rope_scaling: RopeScaling | None = None
    checkpoint_dtype: str = "float32"
    # config.json as read, for families whose fields go beyond these (OWN_CONFIG_TYPES)
    hf_config: dict | None = field(default=None, compare=False, repr=False)
    hybrid: HybridConfig | None = None     # Qwen3-Next / Qwen3.5 / Qwen3.6: linear-attention layers, MoE

    def __post_init__(self):
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"unsupported model_type {self.model_type!r}; "
                             f"pipespec supports {', '.join(SUPPORTED_MODEL_TYPES)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads={self.num_heads} is not a multiple of "
                             f"num_key_value_heads={self.num_kv_heads}")

    @classmethod
    def from_hf(cls, cfg: dict) -> "ArchConfig":
        """Parse a Hugging Face config.json dict (transformers 4.x and 5.x spellings)."""
        model_type = cfg.get("model_type")
        if model_type is None:
            raise ValueError("config.json has no 'model_type' key")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"unsupported model_type {model_type!r} in config.json; "
                             f"pipespec supports {', '.join(SUPPORTED_MODEL_TYPES)}")

        top = cfg
        if model_type in NESTED_MODEL_TYPES:      # a vision-language checkpoint: read its text config
            cfg = dict(cfg.get("text_config") or {})
            # the checkpoint is the top-level model: its flag decides tying (as in transformers)
            cfg["tie_word_embeddings"] = top.get("tie_word_embeddings", cfg.get("tie_word_embeddings", False))

        def need(key: str):
            if key not in cfg:
                raise ValueError(f"config.json is missing the key {key!r}")
            return cfg[key]

        rope = dict(cfg.get("rope_parameters") or {})
        rope.update(cfg.get("rope_scaling") or {})
        theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
        num_heads = need("num_attention_heads")
        hidden = need("hidden_size")
        return cls(
            model_type=model_type,
            vocab_size=need("vocab_size"),
            hidden_size=hidden,
            intermediate_size=cfg.get("intermediate_size") or need("moe_intermediate_size"),
            num_layers=need("num_hidden_layers"),
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or hidden // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            max_position=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=model_type in ("qwen2", "mimo") or bool(cfg.get("attention_bias", False)),
            o_bias=model_type == "llama" and bool(cfg.get("attention_bias", False)),
            qk_norm=model_type == "qwen3",
            rope_scaling=None if model_type in OWN_CONFIG_TYPES else _rope_scaling(rope),
            checkpoint_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or top.get("torch_dtype")
                                 or top.get("dtype") or "float32"),
            hf_config=dict(cfg) if model_type in OWN_CONFIG_TYPES else None,
            hybrid=HybridConfig.from_hf(model_type, cfg) if model_type in HYBRID_MODEL_TYPES else None,
        )


def _rope_scaling(rope: dict) -> RopeScaling | None:
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind in (None, "default"):
        return None
    if kind == "llama3":
        return RopeScaling("llama3", float(rope["factor"]), float(rope.get("low_freq_factor", 1.0)),
                           float(rope.get("high_freq_factor", 4.0)),
                           int(rope.get("original_max_position_embeddings", 8192)))
    if kind == "linear":
        return RopeScaling("linear", float(rope["factor"]))
    raise ValueError(f"unsupported rope_scaling type {kind!r}; pipespec supports llama3 and linear")
