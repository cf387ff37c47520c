"""Finding and loading the MTP layers a last stage drafts with, and wiring them to the target."""
from __future__ import annotations

import logging

import torch
from torch import nn

from pipespec.heads import bundled_head_path
from pipespec.model.mtp import declared_mtp_layers, detect_mtp, dummy_mtp_layers, load_mtp_file, load_mtp_layers
from pipespec.model.tp_layers import SINGLE, VocabParallelEmbedding
from pipespec.model.weights import init_dummy_weights, load_weights
from pipespec.parallel import TensorParallel
from pipespec.speculative.draft_vocab import DraftVocab, holds_draft_vocab
from pipespec.speculative.proposer import MTPProposer

logger = logging.getLogger(__name__)


class EmbeddingCopy(VocabParallelEmbedding):
    """The target's embedding matrix, loaded again for the proposer of a last stage that is not
    stage 0 (I5); with TP, this rank's vocabulary rows of it (as the target's own embedding)."""

    def __init__(self, vocab: int, hidden: int, tp: TensorParallel = SINGLE):
        super().__init__(vocab, hidden, tp)

    def checkpoint_names(self) -> dict[str, list[str]]:
        return {"weight": ["model.embed_tokens.weight"]}


def no_head_message(model: str | None) -> str:
    name = model or "the default model"
    return (f"speculative decoding with method 'mtp' needs MTP weights, and {name} ships none and has no "
            f"bundled head; train one with `pipespec train-mtp --model {model or '<MODEL>'} --out head.safetensors`, "
            "then pass it: on the command line --speculative-config "
            "'{\"method\": \"mtp\", \"num_speculative_tokens\": 3, \"model\": \"head.safetensors\"}', "
            "in Python speculative_config={'method': 'mtp', 'num_speculative_tokens': 3, 'model': 'head.safetensors'}")


def _load_layers(source, config, dtype, device, max_position: int,
                 tp: TensorParallel) -> tuple[list[nn.Module], str, str | None]:
    """(layers, where from, the head file if one): MTP layers from speculative_config.model, else the
    checkpoint's own (random ones, as many as config.json declares, with load_format='dummy'), else
    the bundled head."""
    arch, spec = source.arch, config.speculative
    if spec.model is not None:
        return [load_mtp_file(spec.model, arch, dtype, device, max_position, tp=tp)[0]], spec.model, spec.model
    declared = declared_mtp_layers(source.folder)
    if config.model.load_format == "dummy":
        if not declared:
            raise ValueError(f"load_format='dummy' reads no weights, and {source.folder} declares no MTP layers "
                             "(config.json: num_nextn_predict_layers / mtp_num_hidden_layers) to draw at random; "
                             "pass a head file as speculative_config['model']")
        return (dummy_mtp_layers(arch, declared, dtype, device, max_position, tp=tp),
                f"{declared} random layer(s) (dummy)", None)
    weights = source.weights()
    hit = detect_mtp(weights.names(), arch.num_layers)
    if hit is not None:
        layers = load_mtp_layers(weights, arch, dtype, device, max_position, declared=declared, tp=tp)
        return layers, f"the checkpoint's own {hit[0].family} MTP layers", None
    head = bundled_head_path(config.model.model)
    if head is None:
        raise ValueError(no_head_message(config.model.model))
    return ([load_mtp_file(head, arch, dtype, device, max_position, tp=tp)[0]], f"the bundled head {head.name}",
            str(head))


def build_proposer(target: nn.Module, source, config, dtype: torch.dtype, device: torch.device,
                   max_position: int, tp: TensorParallel = SINGLE) -> MTPProposer:
    """The last stage's proposer, reaching the target's tensors through their owner (I5); on a stage
    without the target's embedding (and no tied head holding a copy) it owns an embedding copy."""
    arch = source.arch
    layers, origin, head_file = _load_layers(source, config, dtype, device, max_position, tp)
    for layer in layers:
        layer.eval()
    k = config.num_spec_tokens
    logger.info("MTP drafting: %d layer(s) from %s, K=%d", len(layers), origin, k)
    draft_vocab, spec = None, config.speculative
    path = None
    if spec.drafts_over_a_vocabulary:
        path = spec.draft_vocab or head_file
        if path is None:
            raise ValueError(f"speculative_config.draft_vocab_size: the drafts come from {origin}, which carry no "
                             f"draft vocabulary; name a file that holds one in speculative_config.draft_vocab "
                             f"(`pipespec draft-vocab` writes one)")
    elif spec.draft_vocab is None and head_file is not None and tp.size == 1 and holds_draft_vocab(head_file):
        path = head_file        # the head's own: a draft step reads its rows of the LM head only
    if path is not None:
        draft_vocab = DraftVocab.from_file(path, spec.draft_vocab_size, arch.vocab_size, device)
        logger.info("MTP drafting over a draft vocabulary of %d of %d tokens (%s; speculative_config "
                    "draft_vocab='full' drafts over all)", draft_vocab.ids.numel(), arch.vocab_size, path)

    copy = None
    if target.model.is_first:
        def embed():
            return target.model.embed_tokens.weight
    elif arch.tie_word_embeddings:
        def embed():              # the last stage's tied head is a copy of the embedding matrix
            return target.head_weight()
    else:
        embed = None
        if any(layer.own_embedding() is None for layer in layers):
            copy = EmbeddingCopy(arch.vocab_size, arch.hidden_size, tp)
            if config.model.load_format == "dummy":     # the values stage 0's embedding drew
                init_dummy_weights(copy, dtype, device, key={"weight": "model.embed_tokens.weight"})
            else:
                load_weights(copy, source.weights(), dtype, device, desc="Loading embedding copy for MTP")
    return MTPProposer(layers, k, config.cache.block_size, embed, target.head_weight, embedding=copy,
                       draft_vocab=draft_vocab)
