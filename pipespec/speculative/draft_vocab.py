"""A draft vocabulary: the MTP proposer drafting over the target's most frequent tokens only.

A draft step reads the whole LM head to pick one token (SmolLM2: a fifth of the model's weights;
Qwen3.5's 248k-token head: a quarter of the 2B model). Over the N most frequent of V tokens it reads
N / V of it. Drafts stay ids of the full vocabulary and verification does not change (the draft
distribution is one-hot on the drafted id either way), so output is unchanged: only acceptance
can fall, where the head's choice lies outside the N tokens (RESULTS.md measures how little).

The list is the tensor `draft_vocab` (token ids, most frequent first, counted in the target's own
answers) of a head file (`train-mtp --draft-vocab N`) or of a file of its own (`pipespec draft-vocab`,
for any MTP layers, a checkpoint's own too): `speculative_config["draft_vocab"]` names the file (default:
the head file), `["draft_vocab_size"] = n` takes its first n. A head file that holds one (the bundled
head does) drafts over it by default at TP = 1; `["draft_vocab"] = "full"` drafts over every token.
"""
from __future__ import annotations

from pathlib import Path

import torch

DRAFT_VOCAB_TENSOR = "draft_vocab"


def read_draft_vocab(path: str | Path, size: int | None, vocab_size: int) -> torch.Tensor:
    """The first `size` ids (None: all) of a file's draft vocabulary, most frequent first; clear errors
    where the file has none, fewer, or ids outside the model's vocabulary."""
    from safetensors import safe_open

    if not Path(path).is_file():
        raise ValueError(f"draft vocabulary file {path}: no such file")
    with safe_open(str(path), framework="pt") as f:
        if DRAFT_VOCAB_TENSOR not in f.keys():
            raise ValueError(f"drafting over a draft vocabulary needs a file that holds one, and {path} has none; "
                             f"write one with `pipespec train-mtp --draft-vocab N` (in a head file) or "
                             f"`pipespec draft-vocab` (a list alone, for any MTP layers), and name it in "
                             f"speculative_config.draft_vocab")
        ids = f.get_tensor(DRAFT_VOCAB_TENSOR).to(torch.int64)
    if size is not None and size > ids.numel():
        raise ValueError(f"speculative_config.draft_vocab_size is {size}, but {path}'s draft vocabulary holds "
                         f"{ids.numel()} tokens")
    ids = ids[:size]
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise ValueError(f"{path}'s draft vocabulary holds ids up to {int(ids.max())}, outside the model's "
                         f"vocabulary of {vocab_size}: it was counted for another tokenizer")
    return ids


def holds_draft_vocab(path: str | Path) -> bool:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return DRAFT_VOCAB_TENSOR in f.keys()


def write_draft_vocab(path: str | Path, ids: torch.Tensor, metadata: dict[str, str]) -> None:
    """A file holding a draft vocabulary alone (ids most frequent first)."""
    from safetensors.torch import save_file

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    save_file({DRAFT_VOCAB_TENSOR: ids.to(torch.int64).contiguous()}, str(path), metadata={"format": "pt", **metadata})


class DraftVocab:
    """The ids a proposer drafts from and its LM head's rows of them. The rows are a copy of the owner's
    head (the target's, or the layer's own), taken at call time and taken again whenever that tensor
    is another or was written since (I5: nothing of the target's is held from construction)."""

    def __init__(self, ids: torch.Tensor):
        # ascending: the first maximum of the draft logits is then the lowest token id holding it, the
        # one the whole vocabulary's argmax picks
        self.ids = ids.to(torch.int64).sort().values
        self._key = None
        self._rows: torch.Tensor | None = None

    @classmethod
    def from_file(cls, path: str | Path, size: int | None, vocab_size: int, device) -> "DraftVocab":
        """`read_draft_vocab`'s ids, on `device`."""
        return cls(read_draft_vocab(path, size, vocab_size).to(device))

    def head_rows(self, weight: torch.Tensor) -> torch.Tensor:
        key = (weight.data_ptr(), weight._version, weight.shape, weight.dtype, weight.device)
        if key != self._key:
            self.ids = self.ids.to(weight.device)
            self._rows = weight.index_select(0, self.ids).contiguous()
            self._key = key
        return self._rows

    def tokens(self, index: torch.Tensor) -> torch.Tensor:
        """Token ids of the full vocabulary from indices into the draft vocabulary's logits."""
        return self.ids[index]
