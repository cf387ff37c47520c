"""The MTP head bundled for the default model: it loads, and reaches its recorded agreement."""
import json
from pathlib import Path

import torch

from pipespec.heads import bundled_head_path, default_model_head_path
from pipespec.model.mtp import load_mtp_file
from pipespec.train.data import load_samples
from pipespec.train.evaluate import agreement

CHECK_SET = Path(__file__).parent / "data" / "smollm2_mtp_check.json"


def test_bundled_head_is_the_default_models_and_is_packaged():
    path = bundled_head_path()
    assert path == default_model_head_path() and path.exists()
    assert 7e6 < path.stat().st_size < 10e6              # bf16, one decoder block + eh_proj
    assert bundled_head_path("/some/other/model.gguf") is None
    pyproject = (Path(__file__).parents[2] / "pyproject.toml").read_text()
    assert '"pipespec.heads" = ["*.safetensors"]' in pyproject


def test_bundled_head_reaches_its_recorded_agreement_on_held_out_text(default_source):
    from pipespec.train.recipe import load_teacher

    head, meta = load_mtp_file(bundled_head_path(), default_source.arch, torch.float32, "cpu")
    assert meta["pipespec.mtp_family"] == "deepseek_v3" and meta["pipespec.layer_index"] == "30"
    recorded = json.loads(meta["pipespec.eval_check"])
    samples = load_samples(CHECK_SET)
    # the check set is held out: its prompts (and their subjects) were never trained on
    assert all(s.start > 0 for s in samples) and len(samples) == 8
    target = load_teacher(default_source, "cpu", torch.float32)
    got = agreement(head, target, samples, len(recorded), "cpu", batch_size=8)
    for r, want in zip(got, recorded):
        assert r.positions == want["positions"]
        assert abs(r.rate - want["agreement"]) <= 0.02, (r.step, r.rate, want)
    assert got[0].rate > 20 * (1 / default_source.arch.vocab_size)
