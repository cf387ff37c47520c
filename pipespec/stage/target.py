"""The target slice: this stage's layers of the target model (its family from `model/registry.py`),
built, loaded, and run forward."""
from __future__ import annotations

import logging

import torch

from pipespec import kernels
from pipespec.checkpoint.source import ModelSource
from pipespec.config import EngineConfig
from pipespec.model.attention import ForwardContext
from pipespec.model.quant.experts import use_dummy_quantized_experts
from pipespec.model.quant.keep import keep_quantized
from pipespec.model.quant.linear import use_dummy_quantized_linears
from pipespec.model.registry import build_target
from pipespec.model.tp_layers import SINGLE
from pipespec.model.weights import init_dummy_weights, load_weights, parameters_on_meta
from pipespec.parallel import TensorParallel

logger = logging.getLogger(__name__)


def load_target(source: ModelSource, config: EngineConfig, layer_range: tuple[int, int], max_position: int,
                dtype: torch.dtype, device: torch.device, tp: TensorParallel = SINGLE) -> torch.nn.Module:
    with parameters_on_meta():      # allocated on the device in their dtype by the loader, nowhere before
        model = build_target(source.arch, layer_range, max_position, tp)
    method = config.model.quantization
    if config.model.load_format == "dummy":
        if method is not None:
            if tp.size > 1 or not kernels.serve_device(device):
                raise ValueError(f"quantization={method!r} with dummy weights runs on the quantized kernels: it "
                                 "needs a CUDA device (with Triton) and tensor_parallel_size=1")
            count = use_dummy_quantized_linears(model, method, device)
            experts = use_dummy_quantized_experts(model, device) if method == "fp8" else 0
            logger.info("dummy %s weights: %d linear layers and %d expert stacks quantized", method, count, experts)
        # a tied head on a stage without the embedding draws the embedding's values, as it loads them
        tied = {"lm_head.weight": "model.embed_tokens.weight"} if source.arch.tie_word_embeddings else None
        init_dummy_weights(model, dtype, device, key=tied)
    else:
        have = source.quant.method if source.quant is not None else None
        if method is not None and method != have:
            raise ValueError(f"quantization={method!r}, but {source.name} is "
                             + (f"quantized with {have!r}" if have else "not quantized (no quantization_config)")
                             + "; pipespec does not quantize a checkpoint at load")
        shard = f" (TP rank {tp.rank} of {tp.size})" if tp.size > 1 else ""
        weights = source.weights()
        keep_quantized(model, weights, device, "target")
        load_weights(model, weights, dtype, device,
                     desc=f"Loading layers {layer_range[0]}-{layer_range[1] - 1}{shard}")
    return model.eval()


def run_target(model: torch.nn.Module, ctx: ForwardContext, input_ids: torch.Tensor,
               inbound: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Stage 0 embeds `input_ids`; later stages continue from the previous stage's activations
    `inbound` [2, T, hidden] (hidden, residual). Returns (hidden, residual); on the last stage hidden
    is final-normed and residual is None."""
    if model.model.is_first:
        return model(ctx, input_ids=input_ids)
    return model(ctx, hidden=inbound[0], residual=inbound[1])
