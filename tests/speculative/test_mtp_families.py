"""Every MTP family end to end, from a checkpoint that ships its own MTP layers: greedy output with
speculation equals greedy output without it for K = 1, 2, 3 at PP = 1 and 2; drafts are mostly right
(so the family's formula runs as the checkpoint means it); with two MTP layers step i drafts with
layer i % 2 and no layer attends to a KV slot nobody wrote; and a last stage without the target's
embedding drafts with a copy the proposer owns.

The checkpoints (tests/model/mtp/tiny_families.py, `echo`): DeepSeek-style with one MTP layer, MiMo
and Qwen3-Next-style with two.
"""
from __future__ import annotations

import pytest
import torch

from pipespec import LLM, SamplingParams
from tests.conftest import assert_engine_clean
from tests.model.mtp import tiny_families as tf

NUM_MTP = {"deepseek": 1, "mimo": 2, "qwen3_next": 2}
KWARGS = dict(dtype="float32", device="cpu", max_model_len=128, block_size=16, num_kv_blocks=64,
              max_num_seqs=8, max_num_batched_tokens=24)
LENGTHS, MAX_TOKENS = (1, 4, 9, 40, 2, 17), (16, 5, 12, 16, 9, 14)


def _spec(k: int) -> dict:
    return {"method": "mtp", "num_speculative_tokens": k}


@pytest.fixture(scope="module")
def echo_models(tmp_path_factory, tokenizer):
    root = tmp_path_factory.mktemp("mtp-echo")
    return {family: str(tf.write_checkpoint(root / family, family,
                                            tf.echo_tensors(family, NUM_MTP[family], 11, 0.1, 0.05),
                                            NUM_MTP[family], tokenizer))
            for family in tf.FAMILIES}


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(3)
    return [{"prompt_token_ids": torch.randint(3, tf.VOCAB, (n,), generator=g).tolist()} for n in LENGTHS]


def _generate(llm: LLM, prompts) -> list[list[int]]:
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS[:len(prompts)]]
    return [out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def references(echo_models, prompts):
    out = {}
    for family, folder in echo_models.items():
        with LLM(model=folder, **KWARGS) as llm:
            out[family] = _generate(llm, prompts)
    return out


def _spy_on_drafting_layers(proposer) -> list[int]:
    """Which layer each draft comes from, in order (the real computation runs unchanged)."""
    order = []
    for index, layer in enumerate(proposer.layers):
        def compute_logits(out, head_weight=None, vocab=None, _index=index, _real=layer.compute_logits):
            order.append(_index)
            return _real(out, head_weight, vocab=vocab)
        layer.compute_logits = compute_logits
    return order


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("pp", [1, 2])
@pytest.mark.parametrize("family", tf.FAMILIES)
def test_greedy_lossless_with_the_checkpoints_own_mtp_layers(family, pp, k, echo_models, prompts, references):
    with LLM(model=echo_models[family], pipeline_parallel_size=pp, speculative_config=_spec(k), **KWARGS) as llm:
        order = None
        if pp == 1:
            proposer = llm.engine.executor.stage.drafter
            assert [layer.family for layer in proposer.layers] == [tf.FAMILY_NAME[family]] * NUM_MTP[family]
            order = _spy_on_drafting_layers(proposer)
        got = _generate(llm, prompts)
        stats = llm.stats()["spec_decode"]
        assert_engine_clean(llm)
    assert got == references[family]
    accepted = stats["accepted_per_position"]
    assert 0.4 < stats["draft_acceptance_rate"] < 1.0          # mostly right, and some rejected
    assert all(a >= accepted[0] / 3 for a in accepted)         # later positions (layer i % n) draft well too
    if order is not None:                                      # step i drafts with layer i % n
        assert len(order) % k == 0 and order == [i % NUM_MTP[family] for i in range(k)] * (len(order) // k)


def _mtp_outputs(folder: str, prompts, fill: float, budget: int) -> list[torch.Tensor]:
    """Every MTP layer output of a run whose MTP KV cache starts filled with `fill`."""
    kwargs = dict(KWARGS, max_num_batched_tokens=budget)
    with LLM(model=folder, speculative_config=_spec(3), **kwargs) as llm:
        proposer = llm.engine.executor.stage.drafter
        for cache in proposer.kv_caches:
            cache.key.fill_(fill)
            cache.value.fill_(fill)
        outs = []
        for layer in proposer.layers:
            layer.register_forward_hook(lambda module, args, out: outs.append(out.clone()))
        _generate(llm, prompts)
    return outs


# budget 256: no prompt is split. budget 16, the 40-token prompt alone: its first chunks are steps
# where nothing samples, and their MTP KV must be written all the same
@pytest.mark.parametrize("budget", [256, 16])
@pytest.mark.parametrize("family", tf.FAMILIES)
def test_no_mtp_layer_reads_a_kv_slot_nobody_wrote(family, budget, echo_models, prompts):
    chosen = prompts if budget == 256 else [prompts[LENGTHS.index(40)]]
    clean, dirty = (_mtp_outputs(echo_models[family], chosen, fill, budget) for fill in (0.0, 30.0))
    assert len(clean) == len(dirty) > 0
    for a, b in zip(clean, dirty):
        torch.testing.assert_close(a, b)


def test_untied_last_stage_proposer_owns_its_embedding_copy(echo_models):
    from pipespec.config import EngineConfig
    from pipespec.stage import Stage
    from pipespec.checkpoint.source import resolve_model

    folder = echo_models["mimo"]
    source = resolve_model(folder)
    assert not source.arch.tie_word_embeddings
    config = EngineConfig.from_kwargs(model=folder, dtype="float32", device="cpu", num_kv_blocks=4,
                                      speculative_config=_spec(2))
    last = Stage(source, config, (1, tf.LAYERS), 64)          # the last of two stages
    copy = last.drafter.embedding
    assert copy is not None and not hasattr(last, "mtp_embedding")
    assert torch.equal(copy.weight, source.weights().get("model.embed_tokens.weight"))
    assert last.drafter._embed_weight() is copy.weight
    held = [m for top in last.modules_with_weights() for m in top.modules()]
    assert any(m is copy for m in held) and all(any(m is layer for m in held) for layer in last.drafter.layers)
    assert sum(p is copy.weight for m in last.modules_with_weights() for p in m.parameters()) == 1    # counted once for the KV budget
    assert copy.weight.is_contiguous()              # embeddings stay row-major on CPU (lookups read rows)
    assert all(m.weight.is_contiguous() for layer in last.drafter.layers            # the layers' linears
               for m in layer.modules() if type(m) is torch.nn.Linear)            # too, as loaded
    # a stage that holds the target's embedding drafts with it, and holds no copy
    whole = Stage(source, config, (0, tf.LAYERS), 64)
    assert whole.drafter.embedding is None
    assert whole.drafter._embed_weight() is whole.model.model.embed_tokens.weight


@pytest.mark.parametrize("family", ["qwen3_next", "deepseek"])
def test_a_checkpoints_own_mtp_layers_draft_over_a_draft_vocabulary_file(family, echo_models, prompts, references,
                                                                          tmp_path):
    from pipespec.speculative.draft_vocab import write_draft_vocab

    # the echo models draft well over the whole vocabulary; half of it, at random, keeps the output
    half = torch.randperm(tf.VOCAB, generator=torch.Generator().manual_seed(0))[:tf.VOCAB // 2]
    write_draft_vocab(tmp_path / "vocab.safetensors", half, {})
    spec = dict(_spec(2), draft_vocab=str(tmp_path / "vocab.safetensors"))
    with LLM(model=echo_models[family], speculative_config=spec, **KWARGS) as llm:
        assert llm.engine.executor.stage.drafter.draft_vocab.ids.tolist() == sorted(half.tolist())
        got = _generate(llm, prompts)
        rate = llm.stats()["spec_decode"]["draft_acceptance_rate"]
        assert_engine_clean(llm)
    assert got == references[family]
    assert 0 < rate < 0.75, rate                 # drafts outside the half are never right
    write_draft_vocab(tmp_path / "wide.safetensors", torch.arange(tf.VOCAB + 8), {})
    with pytest.raises(ValueError, match="outside the model's vocabulary of 512: it was counted for another"):
        LLM(model=echo_models[family], **KWARGS,
            speculative_config=dict(_spec(1), draft_vocab=str(tmp_path / "wide.safetensors")))
