"""Choosing the attention backend and CUDA graphs from the config (CPU)."""
import pytest
import torch

from pipespec.config import ModelConfig
from pipespec.model.attention import TorchReferenceBackend
from pipespec.model.runner import choose_backend


def test_auto_on_cpu_is_the_reference_backend():
    assert isinstance(choose_backend("auto", torch.device("cpu")), TorchReferenceBackend)
    assert isinstance(choose_backend("torch", torch.device("cpu")), TorchReferenceBackend)


def test_triton_on_cpu_is_a_clear_error():
    with pytest.raises(ValueError, match="attention_backend='triton' needs a CUDA device"):
        choose_backend("triton", torch.device("cpu"))


def test_config_rejects_unknown_backend_and_non_bool_eager():
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        ModelConfig(attention_backend="flash")
    with pytest.raises(ValueError, match="enforce_eager must be a bool"):
        ModelConfig(enforce_eager="yes")


def test_cpu_engine_runs_eagerly(llm):
    stage = llm.engine.executor.stage
    assert isinstance(stage.backend, TorchReferenceBackend) and stage.graphs is None
