"""The DeepSeek-V3 / GLM-4.5 MTP layer computes the published formula with the checkpoint's real block:

    out = shared_head.norm(block(eh_proj(cat[enorm(e), hnorm(h)])))      (what chained steps take)

checked against transformers' own decoder layer (DeepseekV3 / Glm4Moe) loaded from the same tensors."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from pipespec.model.attention import ForwardContext, TorchReferenceBackend, allocate_caches
from pipespec.model.mtp import load_mtp_layers
from pipespec.checkpoint.source import resolve_model
from tests.model.deepseek import tiny


def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


# v32: top-k 8 of up to 21 tokens, so the MTP layer's own indexer selection decides its output
@pytest.mark.parametrize("shape", ["lora_yarn", "glm", "v32", "glm5"])
@torch.inference_mode()
def test_mtp_layer_matches_the_formula_on_transformers_block(shape, tmp_path):
    from transformers import AutoModelForCausalLM

    extra = dict(index_topk=8, index_n_heads=16) if shape in ("v32", "glm5") else {}
    folder = tiny.write_with_mtp(tmp_path / "ds", shape, seed=41, pick="random", mixing=1.0, mtp_mixing=1.0, **extra)
    source = resolve_model(str(folder))
    n = source.arch.num_layers
    layer = load_mtp_layers(source.weights(), source.arch, torch.float32, "cpu", max_position=128)[0]
    assert layer.layer_index == n

    # transformers with one more layer reads the MTP block's tensors as its layer n
    more = {}
    if shape in ("v32", "glm5"):                           # its per-layer lists must name layer n too
        cfg = source.arch.hf_config
        more = dict(layer_types=cfg["layer_types"] + ["indexed_attention"],
                    mlp_layer_types=cfg["mlp_layer_types"] + ["sparse"])
        if shape == "glm5":
            more["indexer_types"] = cfg["indexer_types"] + ["full"]
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(str(folder))
    for key, value in dict(more, num_hidden_layers=n + 1).items():
        setattr(config, key, value)
    hf = AutoModelForCausalLM.from_pretrained(str(folder), config=config, dtype=torch.float32).eval()
    t = load_file(str(folder / "model.safetensors"))
    p = f"model.layers.{n}."
    g = torch.Generator().manual_seed(0)
    length = 21                                            # > 16 rows: MLA's expanded form
    ids = torch.randint(3, tiny.VOCAB, (length,), generator=g)
    h = torch.randn(length, 64, generator=g)
    e = F.embedding(ids, t["model.embed_tokens.weight"])
    eps = source.arch.rms_norm_eps
    x = F.linear(torch.cat([_rms(e, t[p + "enorm.weight"], eps), _rms(h, t[p + "hnorm.weight"], eps)], -1),
                 t[p + "eh_proj.weight"])
    pos = torch.arange(length)
    rope = hf.model.rotary_emb(x[None], pos[None])
    causal = torch.ones(length, length, dtype=torch.bool).tril()[None, None]
    block_out = hf.model.layers[n](x[None], attention_mask=causal, position_ids=pos[None], position_embeddings=rope)
    block_out = block_out[0] if isinstance(block_out, tuple) else block_out
    want = _rms(block_out[0], t[p + "shared_head.norm.weight"], eps)

    backend = TorchReferenceBackend()
    for rows_per_step in (length, 4):                      # MLA: expanded, then absorbed against cached latents
        cache = allocate_caches([layer.cache_shape()], 4, 16, torch.float32, "cpu")[0]
        tables = torch.tensor([[0, 1, 2, 3]])
        got = []
        for start in range(0, length, rows_per_step):
            q = torch.arange(start, min(start + rows_per_step, length))
            meta = backend.prepare(torch.tensor([0, len(q)]), torch.tensor([q[-1] + 1]), q, tables, 16)
            ctx = ForwardContext(q, q.clone(), backend, meta, [cache])
            got.append(layer(ctx, ids[q], h[q], embed_weight=t["model.embed_tokens.weight"]))
        got = torch.cat(got)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        # the hidden a chained step takes is the normed one: the head adds no second norm
        head = t["lm_head.weight"]
        torch.testing.assert_close(layer.compute_logits(got, head), F.linear(want, head), atol=1e-4, rtol=1e-4)
