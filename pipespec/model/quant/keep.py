"""Which of a module's weights stay quantized on the device: its projections (`linear.py`) and its
routed experts (`experts.py`), for the target's layers and the MTP layers alike."""
from __future__ import annotations

import logging

import torch
from torch import nn

from pipespec import kernels
from pipespec.model.quant.experts import use_quantized_experts
from pipespec.model.quant.linear import use_quantized_linears
from pipespec.model.quant.source import QuantizedSource

logger = logging.getLogger(__name__)


def keep_quantized(module: nn.Module, source, device: torch.device, what: str) -> None:
    """Before `module` loads from `source`: where the kernels serve `device` and `source` is a
    quantized checkpoint's, its quantized projections and experts stay packed (a log line counts
    them); elsewhere (CPU) everything loads dequantized, the reference."""
    device = torch.device(device)
    if not isinstance(source, QuantizedSource) or not kernels.serve_device(device):
        return
    linears = use_quantized_linears(module, source, device)
    experts = use_quantized_experts(module, source, device)
    logger.info("%s (%s): %d linear layers and %d routed-expert stacks kept quantized (weight-only kernels)",
                what, source.config.method, linears, experts)
