"""The DeepSeek-style MTP module: checkpoint names, forward wiring, and the dense teacher-forced
passes agreeing with what inference computes over a paged KV cache."""
import pytest
import torch
from safetensors.torch import save_file

from pipespec.model.attention import (DenseCausalBackend, ForwardContext, TorchReferenceBackend,
                                      allocate_kv_caches)
from pipespec.model.mtp import DeepSeekMTP, find_mtp_layers, load_mtp
from pipespec.model.weights import SafetensorsSource
from pipespec.train.forward import chained_mtp, target_pass
from tests.speculative.mtp_tiny import tiny_arch, tiny_head, tiny_target

DEEPSEEK_NAMES = ["enorm.weight", "hnorm.weight", "eh_proj.weight", "input_layernorm.weight",
                  "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                  "self_attn.o_proj.weight", "post_attention_layernorm.weight", "mlp.gate_proj.weight",
                  "mlp.up_proj.weight", "mlp.down_proj.weight", "shared_head.norm.weight"]


def test_checkpoint_names_are_deepseek_v3_names_at_layer_num_hidden_layers():
    arch = tiny_arch()
    head = DeepSeekMTP(arch)
    tensors = head.checkpoint_tensors()
    assert set(tensors) == {f"model.layers.{arch.num_layers}.{n}" for n in DEEPSEEK_NAMES}
    p = f"model.layers.{arch.num_layers}."
    h = arch.hidden_size
    assert tensors[p + "eh_proj.weight"].shape == (h, 2 * h)
    assert tensors[p + "self_attn.q_proj.weight"].shape == (arch.num_heads * arch.head_dim, h)
    assert tensors[p + "self_attn.k_proj.weight"].shape == (arch.num_kv_heads * arch.head_dim, h)
    assert tensors[p + "mlp.gate_proj.weight"].shape == (arch.intermediate_size, h)
    assert tensors[p + "mlp.down_proj.weight"].shape == (h, arch.intermediate_size)
    # every checkpoint tensor maps back onto the module's (fused) parameters
    assert sum(t.numel() for t in tensors.values()) == sum(p.numel() for p in head.parameters())


def test_init_from_target_copies_the_last_layer_in_hf_order():
    target = tiny_target()
    head = DeepSeekMTP(target.arch)
    head.init_from_target(target)
    last = target.model.layers[str(target.arch.num_layers - 1)]
    q, k, v = last.self_attn.qkv_proj.weight.split(
        [last.self_attn.q_size, last.self_attn.kv_size, last.self_attn.kv_size])
    tensors = head.checkpoint_tensors()
    p = f"model.layers.{target.arch.num_layers}."
    assert torch.equal(tensors[p + "self_attn.q_proj.weight"], q)
    assert torch.equal(tensors[p + "self_attn.v_proj.weight"], v)
    assert torch.equal(tensors[p + "input_layernorm.weight"], last.input_layernorm.weight)


def test_embedding_and_head_are_taken_at_call_time():
    target = tiny_target()
    head = tiny_head(target.arch)
    assert not any(p is target.model.embed_tokens.weight for p in head.parameters())
    ids = torch.tensor([[3, 5, 7, 9, 11, 13]])
    hidden, _ = target_pass(target, ids)
    out = chained_mtp(head, target, ids, hidden, 1)[0]
    logits = head.compute_logits(out, target.head_weight())
    # the target replaces its embedding tensor: the head must follow, not keep the old one
    with torch.no_grad():
        target.model.embed_tokens.weight = torch.nn.Parameter(target.model.embed_tokens.weight.flip(0).clone())
    out2 = chained_mtp(head, target, ids, hidden, 1)[0]
    assert not torch.allclose(out, out2)
    assert not torch.allclose(logits, head.compute_logits(out2, target.head_weight()))
    with pytest.raises(ValueError, match="embed_weight"):
        head(ForwardContext(torch.zeros(1, dtype=torch.int64), None, DenseCausalBackend(),
                            DenseCausalBackend.metadata(1, 1), []), torch.tensor([1]), hidden[0, :1])


def _paged_context(backend, positions, seq_len, cache, block_size=4, num_blocks=16):
    block_tables = torch.arange(num_blocks)[None, :]
    attn = backend.prepare(torch.tensor([0, len(positions)]), torch.tensor([seq_len]), positions,
                           block_tables, block_size)
    return ForwardContext(positions, positions.clone(), backend, attn, [cache])


def test_dense_target_pass_matches_the_paged_reference_backend():
    target = tiny_target()
    arch = target.arch
    ids = torch.randint(0, arch.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    hidden, logits = target_pass(target, ids)
    backend = TorchReferenceBackend()
    for b in range(2):
        caches = allocate_kv_caches(arch.num_layers, 16, 4, arch.num_kv_heads, arch.head_dim, torch.float32, "cpu")
        positions = torch.arange(12)
        block_tables = torch.arange(16)[None, :]
        attn = backend.prepare(torch.tensor([0, 12]), torch.tensor([12]), positions, block_tables, 4)
        ctx = ForwardContext(positions, positions.clone(), backend, attn, caches)
        with torch.no_grad():
            ref, _ = target(ctx, input_ids=ids[b])
        torch.testing.assert_close(hidden[b], ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(logits[b], target.compute_logits(ref), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("p", [0, 5, 9])
def test_chained_teacher_forcing_matches_paged_inference(p):
    """Step 1 over rows 0..p into a paged cache, then steps 2 and 3 one row each at positions p+1,
    p+2 (what speculative decoding runs) give the teacher-forced pass's outputs at row p."""
    target = tiny_target()
    arch = target.arch
    head = tiny_head(arch)
    ids = torch.randint(0, arch.vocab_size, (1, 14), generator=torch.Generator().manual_seed(1))
    hidden, _ = target_pass(target, ids)
    with torch.no_grad():
        outs = chained_mtp(head, target, ids, hidden, 3)
        embed = target.model.embed_tokens.weight
        cache = allocate_kv_caches(1, 16, 4, arch.num_kv_heads, arch.head_dim, torch.float32, "cpu")[0]
        backend = TorchReferenceBackend()
        positions = torch.arange(p + 1)
        ctx = _paged_context(backend, positions, p + 1, cache)
        step1 = head(ctx, ids[0, 1:p + 2], hidden[0, :p + 1], embed_weight=embed)
        torch.testing.assert_close(step1, outs[0][0, :p + 1], rtol=1e-5, atol=1e-5)
        h = step1[p:p + 1]
        for k in (2, 3):
            pos = p + k - 1
            ctx = _paged_context(backend, torch.tensor([pos]), pos + 1, cache)
            h = head(ctx, ids[0, p + k:p + k + 1], h, embed_weight=embed)
            torch.testing.assert_close(h[0], outs[k - 1][0, p], rtol=1e-5, atol=1e-5)


def test_loader_reads_a_deepseek_checkpoint_with_its_own_embedding_and_head(tmp_path):
    arch = tiny_arch()
    head = tiny_head(arch, own_embedding=True, own_head=True)
    tensors = head.checkpoint_tensors()
    n = arch.num_layers
    assert f"model.layers.{n}.embed_tokens.weight" in tensors
    assert f"model.layers.{n}.shared_head.head.weight" in tensors
    # a whole-model checkpoint: the target's own layers sit beside the MTP layer
    tensors["model.layers.0.self_attn.q_proj.weight"] = torch.zeros(32, 32)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    source = SafetensorsSource([tmp_path / "model.safetensors"])
    assert find_mtp_layers(source.names(), n) == [n]
    loaded = load_mtp(source, arch, torch.float32, "cpu")
    ids = torch.tensor([1, 2, 3])
    hid = torch.randn(3, arch.hidden_size, generator=torch.Generator().manual_seed(0))
    ctx = ForwardContext(torch.arange(3), None, DenseCausalBackend(), DenseCausalBackend.metadata(1, 3), [None])
    with torch.no_grad():
        want = head.compute_logits(head(ctx, ids, hid))          # no target tensors needed
        got = loaded.compute_logits(loaded(ctx, ids, hid))
    torch.testing.assert_close(got, want)


def test_loader_refuses_a_checkpoint_without_mtp_layer(tmp_path):
    arch = tiny_arch()
    save_file({"model.layers.0.input_layernorm.weight": torch.ones(32)}, str(tmp_path / "m.safetensors"))
    with pytest.raises(ValueError, match="no MTP layer"):
        load_mtp(SafetensorsSource([tmp_path / "m.safetensors"]), arch, torch.float32, "cpu")



def test_dense_backend_prepares_equal_length_batches_and_refuses_others():
    backend = DenseCausalBackend()
    meta = backend.prepare(torch.tensor([0, 5, 10]), torch.tensor([5, 5]), torch.arange(10), None, 16)
    assert (meta.batch, meta.seq_len) == (2, 5)
    with pytest.raises(ValueError, match="equal-length"):
        backend.prepare(torch.tensor([0, 5, 9]), torch.tensor([5, 4]), torch.arange(9), None, 16)
    with pytest.raises(ValueError, match="no cached prefix"):
        backend.prepare(torch.tensor([0, 1]), torch.tensor([6]), torch.tensor([5]), None, 16)


@pytest.mark.parametrize("pp", [1, 2])
def test_a_head_with_a_wider_mlp_serves_lossless_speculation(tiny_models, tmp_path, pp):
    """A head file whose block has twice the target's MLP width (`train-mtp --block-intermediate`)
    loads into the engine at any pipeline size: greedy output equals the engine's without
    speculation, and drafts were made and verified."""
    import dataclasses
    from pipespec import LLM, SamplingParams
    from pipespec.model.mtp import save_mtp
    from pipespec.checkpoint.source import resolve_model
    from tests.speculative.mtp_tiny import randomize
    folder = tiny_models["llama"][0]
    arch = resolve_model(str(folder)).arch
    head = DeepSeekMTP(dataclasses.replace(arch, intermediate_size=2 * arch.intermediate_size))
    randomize(head, seed=7)
    path = tmp_path / "wide.safetensors"
    save_mtp(path, head, "tiny-llama", base_arch=arch)
    prompts = [{"prompt_token_ids": list(range(5 + i, 12 + 3 * i))} for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    kw = dict(model=str(folder), device="cpu", dtype="float32", num_kv_blocks=32, max_model_len=64)
    with LLM(**kw) as llm:
        want = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    spec = {"method": "mtp", "num_speculative_tokens": 2, "model": str(path)}
    with LLM(pipeline_parallel_size=pp, speculative_config=spec, **kw) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert llm.stats()["spec_decode"]["num_draft_tokens"] > 0
    assert got == want
