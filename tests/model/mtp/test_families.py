"""Each MTP family, from a tiny checkpoint written in its real tensor names: it is detected from the
names, every tensor is loaded (none left over, none missing), and the module computes the family's
formula as written out in plain PyTorch in tiny_families.py."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from pipespec.model.attention import DenseCausalBackend, ForwardContext
from pipespec.model.layers import RMSNorm
from pipespec.model.llama import LlamaForCausalLM
from pipespec.model.mtp import declared_mtp_layers, detect_mtp, load_mtp_layers
from pipespec.model.norms import ZeroCentredRMSNorm
from pipespec.checkpoint.source import resolve_model
from pipespec.model.weights import SafetensorsSource
from tests.model.mtp import tiny_families as tf

NUM_MTP = 2


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{family: (folder, tensors)}: random weights, two MTP layers each."""
    root = tmp_path_factory.mktemp("mtp-families")
    out = {}
    for seed, family in enumerate(tf.FAMILIES):
        tensors = tf.random_tensors(family, NUM_MTP, seed)
        out[family] = (tf.write_checkpoint(root / family, family, tensors, NUM_MTP), tensors)
    return out


def _load(folder):
    source = resolve_model(folder)
    weights = source.weights()
    layers = load_mtp_layers(weights, source.arch, torch.float32, "cpu", declared=declared_mtp_layers(folder))
    return source, weights, layers


@pytest.mark.parametrize("family", tf.FAMILIES)
def test_family_is_detected_and_every_tensor_is_loaded(family, checkpoints):
    folder, tensors = checkpoints[family]
    source, weights, layers = _load(folder)
    kind, indices = detect_mtp(weights.names(), source.arch.num_layers)
    assert kind.family == tf.FAMILY_NAME[family]
    assert [layer.family for layer in layers] == [tf.FAMILY_NAME[family]] * NUM_MTP
    assert indices == ([tf.LAYERS, tf.LAYERS + 1] if family == "deepseek" else [0, 1])
    # the target's tensors and the MTP layers' together are exactly the checkpoint: none unused, none missing
    target_names = {c for cs in LlamaForCausalLM(source.arch).checkpoint_names().values() for c in cs}
    mtp_names = {c for layer in layers for cs in layer.checkpoint_names().values() for c in cs}
    assert mtp_names == set(tf.shapes(family, NUM_MTP)[1])
    assert target_names | mtp_names == set(tensors) and not target_names & mtp_names
    for layer in layers:
        for name, value in layer.checkpoint_tensors().items():
            assert torch.equal(value, tensors[name]), name


def test_qwen3_next_layers_share_one_input_projection_and_norm(checkpoints):
    _, _, layers = _load(checkpoints["qwen3_next"][0])
    assert layers[0].shared is layers[1].shared
    assert layers[0].block is not layers[1].block
    both = torch.nn.ModuleList(layers)
    fc = layers[0].shared.fc.weight
    assert sum(p is fc for p in both.parameters()) == 1      # counted once where weights are counted


def _dense_ctx(n: int) -> ForwardContext:
    return ForwardContext(torch.arange(n), None, DenseCausalBackend(), DenseCausalBackend.metadata(1, n), [None])


@pytest.mark.parametrize("family", tf.FAMILIES)
def test_forward_and_chained_step_compute_the_family_formula(family, checkpoints):
    folder, tensors = checkpoints[family]
    _, _, layers = _load(folder)
    g = torch.Generator().manual_seed(5)
    n = 7
    positions = torch.arange(n)
    embed, head = tensors["model.embed_tokens.weight"], tensors["lm_head.weight"]
    for i, layer in enumerate(layers):
        ids1, ids2 = torch.randint(0, tf.VOCAB, (2, n), generator=g)
        hidden = torch.randn(n, tf.H, generator=g)
        with torch.no_grad():
            out1 = layer(_dense_ctx(n), ids1, hidden, embed_weight=embed)
            out2 = layer(_dense_ctx(n), ids2, out1, embed_weight=embed)      # a chained step feeds out1 back
            logits = layer.compute_logits(out2, head)
        want1, _ = tf.mtp_step(tensors, family, i, ids1, hidden, positions)
        want2, want_logits = tf.mtp_step(tensors, family, i, ids2, want1, positions)
        torch.testing.assert_close(out1, want1, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(out2, want2, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(logits, want_logits, rtol=1e-4, atol=1e-4)
        # the check has teeth: the other concat order gives other outputs
        own, _ = tf.mtp_prefixes(family, i)
        proj = own + tf._PROJ[family] + ".weight"
        swapped = {**tensors, proj: tensors[proj].roll(tf.H, dims=1)}
        assert not torch.allclose(out1, tf.mtp_step(swapped, family, i, ids1, hidden, positions)[0], atol=1e-2)


def test_config_counts_choose_and_check_the_layers(checkpoints, tmp_path):
    folder, _ = checkpoints["mimo"]
    source = resolve_model(folder)
    weights = source.weights()
    one = load_mtp_layers(weights, source.arch, torch.float32, "cpu", declared=1)
    assert [layer.layer_index for layer in one] == [0]
    with pytest.raises(ValueError, match="declares 3 MTP layers, but the checkpoint holds 2"):
        load_mtp_layers(weights, source.arch, torch.float32, "cpu", declared=3)
    # Qwen3.5 keeps the count in text_config; a count of 0 (MiMo's config default) says nothing
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"mtp_num_hidden_layers": 1}}))
    assert declared_mtp_layers(tmp_path) == 1
    (tmp_path / "config.json").write_text(json.dumps({"num_nextn_predict_layers": 0}))
    assert declared_mtp_layers(tmp_path) is None


def test_checkpoint_with_two_families_or_none_is_refused(tmp_path):
    arch = resolve_model(tf.write_checkpoint(tmp_path / "m", "mimo", tf.random_tensors("mimo", 1, 0), 1)).arch
    save_file({f"model.layers.{arch.num_layers}.eh_proj.weight": torch.zeros(tf.H, 2 * tf.H),
               "mtp.fc.weight": torch.zeros(tf.H, 2 * tf.H), "mtp.layers.0.input_layernorm.weight": torch.ones(tf.H)},
              str(tmp_path / "two.safetensors"))
    with pytest.raises(ValueError, match="several families"):
        load_mtp_layers(SafetensorsSource([tmp_path / "two.safetensors"]), arch, torch.float32, "cpu")
    save_file({"model.layers.0.input_layernorm.weight": torch.ones(tf.H)}, str(tmp_path / "none.safetensors"))
    with pytest.raises(ValueError, match="no MTP layer.*mtp_layers.*mtp.fc"):
        load_mtp_layers(SafetensorsSource([tmp_path / "none.safetensors"]), arch, torch.float32, "cpu")


def test_zero_centred_norm_scales_by_one_plus_weight():
    x, res = torch.randn(3, 8), torch.randn(3, 8)
    plain, centred = RMSNorm(8, 1e-6), ZeroCentredRMSNorm(8, 1e-6)
    torch.testing.assert_close(centred(x), plain(x))              # weight 0 means scale 1
    with torch.no_grad():
        centred.weight.fill_(0.5)
        plain.weight.fill_(1.5)
    out, new_res = centred(x, res)
    want, want_res = plain(x, res)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(new_res, want_res)
