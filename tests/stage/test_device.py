"""Choosing the attention backend and CUDA graphs from the config (CPU)."""
import pytest
import torch

from pipespec.config import ModelConfig
from pipespec.model.attention import TorchReferenceBackend
from pipespec.model.attention import choose_backend


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


def test_a_stage_holding_a_tensor_on_another_device_is_named(tiny_models):
    """The check `allocate_kv_cache` runs: every tensor a stage holds is on the stage's device (on
    CPU a 'meta' tensor stands in for another GPU)."""
    from pipespec.config import EngineConfig
    from pipespec.checkpoint.source import resolve_model
    from pipespec.stage import Stage
    from pipespec.stage.device import tensors_off_device

    folder = tiny_models["llama"][0]
    source = resolve_model(str(folder))
    config = EngineConfig.from_kwargs(model=str(folder), dtype="float32", device="cpu", num_kv_blocks=4)
    stage = Stage(source, config, (0, 3), 64)
    stage.allocate_kv_cache(4)
    assert tensors_off_device(stage, stage.device) == []
    stage.kv_caches[1].value = torch.empty(stage.kv_caches[1].value.shape, device="meta")
    stage.model.model.norm.weight = torch.nn.Parameter(stage.model.model.norm.weight.to("meta"))
    assert tensors_off_device(stage, stage.device) == ["stage.model.model.norm.weight on meta",
                                                       "stage.kv_caches.1.value on meta"]
    with pytest.raises(RuntimeError, match=r"stage on cpu holds tensors elsewhere: stage\.model\.model\.norm\.weight on meta"):
        stage.allocate_kv_cache(4)


@pytest.mark.parametrize("shape,sparse", [("lora_yarn", False), ("v32", True)])
def test_sparse_attention_models_take_the_torch_backend(shape, sparse):
    """DeepSeek sparse attention selects keys on the torch backend only: 'auto' picks it (on a GPU
    too), an explicit 'triton' is refused by name; dense MLA is not held back."""
    from pipespec.model.arch import ArchConfig
    from pipespec.model.registry import build_target
    from tests.model.deepseek.tiny import hf_config

    cfg = hf_config(shape).to_dict()
    model = build_target(ArchConfig.from_hf(cfg), (0, cfg["num_hidden_layers"]), 64)
    assert model.reference_attention_only is sparse
    for device in ("cpu", "cuda"):
        assert isinstance(choose_backend("auto", torch.device(device), model), TorchReferenceBackend) or not sparse
    if sparse:
        with pytest.raises(ValueError, match="does not serve deepseek_v32"):
            choose_backend("triton", torch.device("cuda"), model)


class _Graphs:
    """Stands in for a stage's graph set (CUDA only): records when its graphs are destroyed."""

    def __init__(self, order: list):
        self.order = order

    def release(self):
        self.order.append("graphs destroyed")


class ProcessGroupNCCL:
    """Stands in for an NCCL group (named like one: only those are shut down explicitly)."""

    def __init__(self, order: list):
        self.order = order

    def size(self) -> int:
        return 2

    def shutdown(self):
        self.order.append("tp group shut down")


def test_close_destroys_the_cuda_graphs_before_shutting_the_tp_group_down(tiny_models):
    """NCCL frees a communicator only once the CUDA graphs that captured its collectives are
    destroyed, and an NCCL group left to its destructor was seen to hang 30 s and more on two
    H200s: the stage destroys its graphs, then shuts its group down, explicitly and in that order."""
    from pipespec.config import EngineConfig
    from pipespec.checkpoint.source import resolve_model
    from pipespec.parallel import TensorParallel
    from pipespec.stage import Stage

    folder = tiny_models["llama"][0]
    config = EngineConfig.from_kwargs(model=str(folder), dtype="float32", device="cpu", num_kv_blocks=4)
    stage = Stage(resolve_model(str(folder)), config, (0, 3), 64)
    order = []
    stage.tp = TensorParallel(0, 2)
    stage.tp.attach(ProcessGroupNCCL(order))
    stage.graphs = _Graphs(order)
    stage.close()
    assert order == ["graphs destroyed", "tp group shut down"]
    assert stage.graphs is None
