"""GGUF checkpoints (llama and qwen2 architectures): config, tensors, tokenizer metadata.

Tensors are dequantized with the `gguf` library and renamed to Hugging Face names. llama.cpp's
converter permutes the q/k rows of Llama-architecture checkpoints for its interleaved RoPE; we undo
that, so every tensor follows Hugging Face conventions (rotate-half RoPE, [out, in] matrices).
"""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch

from pipespec.model.arch import ArchConfig

GGUF_ARCHS = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")


def hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _BLOCK.match(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
    return None


class GGUFFile:
    def __init__(self, path: Path):
        import gguf  # imported here: only GGUF users pay for it

        self.path = Path(path)
        self._reader = gguf.GGUFReader(str(path))
        self._dequantize = gguf.quants.dequantize
        self.meta = {}
        for key, field in self._reader.fields.items():
            if key.startswith("GGUF."):
                continue
            self.meta[key] = field.contents()
        arch = self.meta.get("general.architecture")
        if arch not in GGUF_ARCHS:
            raise ValueError(f"unsupported GGUF architecture {arch!r} in {path}; "
                             f"pipespec reads {', '.join(GGUF_ARCHS)}")
        self.gguf_arch = arch
        self._tensors = {}
        for t in self._reader.tensors:
            name = hf_name(t.name)
            if name is not None:
                self._tensors[name] = t
        if any(t.name == "rope_freqs.weight" for t in self._reader.tensors):
            raise ValueError(f"{path} carries rope_freqs.weight (Llama-3.1 rope scaling), which the "
                             "GGUF loader does not read; load the Hugging Face folder instead")
        self.arch = self._arch_config()

    def _key(self, suffix: str, default=None):
        value = self.meta.get(f"{self.gguf_arch}.{suffix}", default)
        if value is None:
            raise ValueError(f"GGUF metadata key {self.gguf_arch}.{suffix!r} is missing in {self.path}")
        return value

    def _arch_config(self) -> ArchConfig:
        heads = int(self._key("attention.head_count"))
        hidden = int(self._key("embedding_length"))
        vocab = len(self.meta.get("tokenizer.ggml.tokens") or []) or int(self._key("vocab_size"))
        return ArchConfig(
            model_type=GGUF_ARCHS[self.gguf_arch],
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=int(self._key("feed_forward_length")),
            num_layers=int(self._key("block_count")),
            num_heads=heads,
            num_kv_heads=int(self._key("attention.head_count_kv", heads)),
            head_dim=int(self.meta.get(f"{self.gguf_arch}.attention.key_length", hidden // heads)),
            rms_norm_eps=float(self._key("attention.layer_norm_rms_epsilon")),
            rope_theta=float(self._key("rope.freq_base", 10000.0)),
            max_position=int(self._key("context_length")),
            tie_word_embeddings="lm_head.weight" not in self._tensors,
            qkv_bias="model.layers.0.self_attn.q_proj.bias" in self._tensors,
            qk_norm=GGUF_ARCHS[self.gguf_arch] == "qwen3",
        )

    def names(self) -> set[str]:
        return set(self._tensors)

    def float_dtype(self, name: str) -> torch.dtype | None:
        """The tensor's own type when the file stores it as plain floats; None when quantized."""
        from gguf import GGMLQuantizationType as Q

        return {Q.F32: torch.float32, Q.F16: torch.float16, Q.BF16: torch.bfloat16}.get(
            self._tensors[name].tensor_type)

    def get(self, name: str) -> torch.Tensor:
        t = self._tensors[name]
        data = np.asarray(self._dequantize(t.data, t.tensor_type), dtype=np.float32)
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))   # GGUF lists dims innermost first
        tensor = torch.from_numpy(data.reshape(shape).copy())
        if self.gguf_arch == "llama":
            if ".self_attn.q_proj." in name:
                tensor = _unpermute(tensor, self.arch.num_heads)
            elif ".self_attn.k_proj." in name:
                tensor = _unpermute(tensor, self.arch.num_kv_heads)
        return tensor


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    # llama.cpp stored each head's rows as interleaved (even, odd) pairs; restore the two halves.
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)
