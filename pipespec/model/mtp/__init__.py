"""MTP (multi-token prediction) draft layers: one shared contract (`base`), one file per family,
detection and loading from checkpoints (`loading`), and pipespec's own head files (`files`).

| family                      | tensors                                                        |
|-----------------------------|----------------------------------------------------------------|
| DeepSeek-V3/R1, GLM-4.5/4.6 | model.layers.{N}.enorm/hnorm/eh_proj/shared_head.* + block      |
| MiMo-7B                     | model.mtp_layers.{i}.token_/hidden_layernorm/input_proj/final_layernorm + block |
| Qwen3-Next, Qwen3.5         | mtp.pre_fc_norm_embedding/pre_fc_norm_hidden/fc/norm + mtp.layers.{i} |
"""
from pipespec.model.mtp.base import MTPLayer, dense_block
from pipespec.model.mtp.deepseek import FAMILY_DEEPSEEK, DeepSeekMTP
from pipespec.model.mtp.files import (META_BASE_CONFIG, META_BASE_MODEL, META_FAMILY, META_LAYER_INDEX,
                                      load_mtp_file, read_mtp_metadata, save_mtp)
from pipespec.model.mtp.loading import (FAMILIES, declared_mtp_layers, detect_mtp, dummy_mtp_layers, find_mtp_layers,
                                        load_mtp, load_mtp_layers)
from pipespec.model.mtp.mimo import FAMILY_MIMO, MiMoMTP
from pipespec.model.mtp.qwen3_next import FAMILY_QWEN3_NEXT, Qwen3NextMTP, Qwen3NextMTPShared

__all__ = ["FAMILIES", "FAMILY_DEEPSEEK", "FAMILY_MIMO", "FAMILY_QWEN3_NEXT", "META_BASE_CONFIG",
           "META_BASE_MODEL", "META_FAMILY", "META_LAYER_INDEX", "DeepSeekMTP", "MTPLayer", "MiMoMTP",
           "Qwen3NextMTP", "Qwen3NextMTPShared", "declared_mtp_layers", "dense_block", "detect_mtp", "dummy_mtp_layers",
           "find_mtp_layers", "load_mtp", "load_mtp_file", "load_mtp_layers", "read_mtp_metadata", "save_mtp"]
