"""A draft vocabulary: the MTP proposer drafting over the target's most frequent tokens only.

A draft step reads the whole LM head to pick one token (SmolLM2: a fifth of the model's weights;
Qwen3.5's 248k-token head: a quarter of the 2B model). Over the N most frequent of V tokens it reads
N / V of it. Drafts stay ids of the full vocabulary and verification does not change (the draft
distribution is one-hot on the drafted id either way), so output is unchanged: only acceptance
can fall, where the head's choice lies outside the N tokens (RESULTS.md measures how little).

A head file carries the list as the tensor `draft_vocab` (token ids, most frequent first; `train-mtp
--draft-vocab N` counts them in the target's own answers); `speculative_config["draft_vocab_size"]
= n` drafts over its first n.
"""
from __future__ import annotations

from pathlib import Path

import torch

DRAFT_VOCAB_TENSOR = "draft_vocab"


def read_draft_vocab(path: str | Path, size: int) -> torch.Tensor:
    """The first `size` ids of a head file's draft vocabulary, ascending (a clear error where the file
    has none or fewer)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        if DRAFT_VOCAB_TENSOR not in f.keys():
            raise ValueError(f"speculative_config.draft_vocab_size needs a head file with a draft vocabulary, and "
                             f"{path} has none; write one with `pipespec train-mtp --draft-vocab N`")
        ids = f.get_tensor(DRAFT_VOCAB_TENSOR)
    if size > ids.numel():
        raise ValueError(f"speculative_config.draft_vocab_size is {size}, but {path}'s draft vocabulary holds "
                         f"{ids.numel()} tokens")
    return ids[:size].to(torch.int64).sort().values


class DraftVocab:
    """The ids a proposer drafts from and its LM head's rows of them. The rows are a copy of the owner's
    head (the target's, or the layer's own), taken at call time and taken again whenever that tensor
    is another or was written since (I5: nothing of the target's is held from construction)."""

    def __init__(self, ids: torch.Tensor):
        self.ids = ids
        self._key = None
        self._rows: torch.Tensor | None = None

    def head_rows(self, weight: torch.Tensor) -> torch.Tensor:
        key = (weight.data_ptr(), weight._version, weight.shape, weight.dtype, weight.device)
        if key != self._key:
            self._rows = weight.index_select(0, self.ids.to(weight.device)).contiguous()
            self.ids = self.ids.to(weight.device)
            self._key = key
        return self._rows

    def tokens(self, index: torch.Tensor) -> torch.Tensor:
        """Token ids of the full vocabulary from indices into the draft vocabulary's logits."""
        return self.ids[index]
