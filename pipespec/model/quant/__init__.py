"""Quantized checkpoints: FP8 with block scales, AWQ and GPTQ int4, read through `QuantizedSource`.

The CPU path dequantizes each weight once, at load, into the engine's dtype: the reference the GPU
kernels are checked against. Where the kernels serve, projections (`linear.py`) and routed experts
(`experts.py`) stay packed (`keep.py`).
"""
from pipespec.model.quant.config import QuantConfig, SUPPORTED_METHODS, read_quant_config
from pipespec.model.quant.source import QuantizedSource, refuse_unrecognised_quantization

__all__ = ["QuantConfig", "SUPPORTED_METHODS", "QuantizedSource", "read_quant_config",
           "refuse_unrecognised_quantization"]
