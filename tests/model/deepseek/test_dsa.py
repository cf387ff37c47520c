"""DeepSeek sparse attention (V3.2, and GLM-5 with a layer reusing the previous one's selection)
where the top-k actually drops tokens (index_topk 8 < 40 tokens).

The selection alone is checked against a row-by-row reference of the published rule; the model's
logits, whether the prompt runs as one prefill, in chunks or one token per step (each step scoring
the indexer keys earlier steps cached), equal transformers' uncached forward, which applies the rule
to the whole sequence at once (its cached path disagrees once tokens are dropped, so it is not used).
"""
from __future__ import annotations

import pytest
import torch

from pipespec import LLM
from pipespec.model.deepseek.dsa import select_topk
from tests.helpers import engine_logits, hf_logits
from tests.model.deepseek import tiny

TOPK = 8


def _reference_selection(scores, allowed, k):
    """Per row: the allowed keys by score, best first, ties to the earlier key; the first k."""
    out = torch.zeros_like(allowed)
    for g in range(scores.shape[0]):
        for q in range(scores.shape[1]):
            keys = allowed[g, q].nonzero().flatten().tolist()
            best = sorted(keys, key=lambda j: (-scores[g, q, j].item(), j))[:k]
            out[g, q, best] = True
    return out


def test_selection_keeps_the_k_best_allowed_keys():
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(3, 6, 20, generator=g).relu()        # exact ties at 0, as the indexer's relu makes
    allowed = torch.rand(3, 6, 20, generator=g) < 0.6
    allowed[0, 0] = False
    allowed[0, 0, 3] = True                         # fewer allowed keys than k: all of them
    for k in (1, 5, 19, 25):
        assert torch.equal(select_topk(scores, allowed, k), _reference_selection(scores, allowed, k)), k


@pytest.fixture(scope="module", params=["v32", "glm5"])
def sparse(request, tmp_path_factory, tokenizer):
    # 16 indexer heads: a key scoring exactly 0 for a row (every head's relu 0) is then rare enough
    # that transformers' arbitrary tie order does not matter here
    shape = request.param
    folder, hf = tiny.write_model(tmp_path_factory.mktemp(shape) / "m", shape, seed=50, tokenizer=tokenizer,
                                  index_topk=TOPK, index_n_heads=16)
    llm = LLM(model=str(folder), dtype="float32", device="cpu", max_model_len=128, num_kv_blocks=16,
              max_num_batched_tokens=64)
    yield llm, hf, shape
    llm.shutdown()


def test_sparse_logits_match_the_whole_sequence_rule(sparse):
    llm, hf, _ = sparse
    ids = torch.randint(3, tiny.VOCAB, (40,), generator=torch.Generator().manual_seed(8)).tolist()
    ref = hf_logits(hf, ids)
    hf.config.index_topk = 64           # the same weights attending densely: dropping tokens must matter
    indexers = [layer.self_attn.indexer for layer in hf.model.layers if layer.self_attn.indexer is not None]
    for indexer in indexers:
        indexer.index_topk = 64
    dense = hf_logits(hf, ids)
    for indexer in indexers:
        indexer.index_topk = TOPK
    assert (dense[TOPK + 4:] - ref[TOPK + 4:]).abs().max() > 0.1
    torch.testing.assert_close(dense[:TOPK], ref[:TOPK], atol=1e-4, rtol=0)   # nothing dropped yet
    for chunk in (None, 13, 1):
        ours = engine_logits(llm, ids, chunk=chunk)
        diff = (ours - ref).abs().max().item()
        assert diff < 1e-4, f"chunk={chunk}: max |logit diff| {diff:.2e}"


def test_cache_entry_holds_the_indexer_key(sparse):
    stage, shape = sparse[0].engine.executor.stage, sparse[2]
    widths = [32 + 8 + 16] * 3 if shape == "v32" else [32 + 8 + 16, 32 + 8, 32 + 8 + 16, 32 + 8 + 16]  # shared: no key
    assert [tuple(c.key.shape[1:]) for c in stage.kv_caches] == [(1, w) for w in widths]
    assert stage._bytes_per_block() == sum(widths) * 4 * stage.block_size


def test_a_stage_cannot_start_at_a_layer_reusing_an_earlier_selection():
    from pipespec.model.arch import ArchConfig
    from pipespec.model.deepseek.model import DeepseekV3ForCausalLM
    arch = ArchConfig.from_hf(tiny.hf_config("glm5").to_dict())
    assert arch.model_type == "glm_moe_dsa"
    DeepseekV3ForCausalLM(arch, (2, 4))
    with pytest.raises(ValueError, match="layer 1 is 'shared'"):
        DeepseekV3ForCausalLM(arch, (1, 4))


@pytest.mark.parametrize("kinds,ok", [(["indexed_attention"], True), (["deepseek_sparse_attention"], True),
                                      (["full_attention"], False)])
def test_both_transformers_names_of_the_sparse_layer_type_are_read(kinds, ok):
    """transformers 5.24 writes layer_types 'indexed_attention', 5.17 'deepseek_sparse_attention'."""
    from pipespec.model.deepseek.config import parse_index
    cfg = dict(tiny.hf_config("v32").to_dict(), layer_types=kinds * tiny.V32["num_hidden_layers"])
    if ok:
        assert parse_index(cfg).topk == tiny.V32["index_topk"]
    else:
        with pytest.raises(ValueError, match="unsupported layer_types"):
            parse_index(cfg)
