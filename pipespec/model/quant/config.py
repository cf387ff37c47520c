"""`quantization_config` of a checkpoint's config.json, checked: a method or layout pipespec does
not read is refused by name, never loaded as if it were plain weights."""
from __future__ import annotations

from dataclasses import dataclass

SUPPORTED_METHODS = ("fp8 (block-scaled e4m3, weight_scale_inv)", "awq (4-bit, GEMM layout)",
                     "gptq (4-bit, with or without act-order)")


@dataclass(frozen=True)
class QuantConfig:
    method: str                              # "fp8", "awq" or "gptq"
    bits: int = 8
    group_size: int = 0                      # awq / gptq: input rows sharing a scale and zero
    block: tuple[int, int] = (128, 128)      # fp8: [output, input] rows per scale block
    act_order: bool = False                  # gptq desc_act: groups follow g_idx, not row order
    not_converted: tuple[str, ...] = ()      # module names kept in full precision

    def converts(self, module: str) -> bool:
        """Whether `module` (a checkpoint prefix like 'model.layers.0.mlp.down_proj') is quantized."""
        return not any(module == m or module.endswith("." + m) or module.startswith(m + ".")
                       for m in self.not_converted)


def _unsupported(what: str) -> ValueError:
    return ValueError(f"{what}; pipespec reads {', '.join(SUPPORTED_METHODS)}")


def read_quant_config(cfg: dict) -> QuantConfig | None:
    """From a config.json dict (the text config's, for nested multimodal checkpoints)."""
    q = cfg.get("quantization_config") or (cfg.get("text_config") or {}).get("quantization_config")
    if not q:
        return None
    method = str(q.get("quant_method", "")).lower()
    skip = tuple(q.get("modules_to_not_convert") or q.get("ignored_layers") or ())
    if method == "fp8":
        if q.get("fmt", "e4m3") != "e4m3":
            raise _unsupported(f"fp8 format {q.get('fmt')!r} is not supported")
        block = q.get("weight_block_size")
        if not block or len(block) != 2:
            raise _unsupported("fp8 without weight_block_size (per-tensor scales) is not supported")
        return QuantConfig("fp8", 8, block=(int(block[0]), int(block[1])), not_converted=skip)
    if method in ("awq", "gptq"):
        bits, group = int(q.get("bits", q.get("w_bit", 4))), int(q.get("group_size", q.get("q_group_size", 128)))
        if bits != 4:
            raise _unsupported(f"{method} with {bits}-bit weights is not supported")
        if group <= 0:
            raise _unsupported(f"{method} with group_size {group} (one group per row) is not supported")
        if method == "awq":
            version = str(q.get("version", "gemm")).lower()
            if version != "gemm" or not q.get("zero_point", True):
                raise _unsupported(f"awq version {version!r} (zero_point={q.get('zero_point', True)}) is not supported")
            return QuantConfig("awq", 4, group_size=group, not_converted=skip)
        if str(q.get("checkpoint_format", "gptq")).lower() != "gptq":
            raise _unsupported(f"gptq checkpoint_format {q.get('checkpoint_format')!r} is not supported")
        return QuantConfig("gptq", 4, group_size=group, act_order=bool(q.get("desc_act", False)),
                           not_converted=skip)
    raise _unsupported(f"the checkpoint is quantized with {method or 'an unnamed method'!r}, which pipespec "
                       "does not read")
