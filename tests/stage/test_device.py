"""Choosing the attention backend and CUDA graphs from the config (CPU)."""
import pytest
import torch

from pipespec.config import ModelConfig
from pipespec.model.attention import TorchReferenceBackend
from pipespec.stage.device import choose_backend


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
    from pipespec.model.source import resolve_model
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


class _Dropped:
    """Records when it is freed (stands in for a graph set and a process group: only the order counts)."""

    def __init__(self, name: str, order: list, size: int = 2):
        self.name, self.order, self._size = name, order, size

    def size(self) -> int:
        return self._size

    def __del__(self):
        self.order.append(self.name)


def test_close_frees_the_cuda_graphs_before_the_tp_group(tiny_models):
    """NCCL destroys a communicator only once the CUDA graphs that captured its collectives are
    freed: a TP = 2 engine whose stage dropped its group first hung at shutdown on two H200s."""
    from pipespec.config import EngineConfig
    from pipespec.model.source import resolve_model
    from pipespec.parallel import TensorParallel
    from pipespec.stage import Stage

    folder = tiny_models["llama"][0]
    config = EngineConfig.from_kwargs(model=str(folder), dtype="float32", device="cpu", num_kv_blocks=4)
    stage = Stage(resolve_model(str(folder)), config, (0, 3), 64)
    order = []
    stage.tp = TensorParallel(0, 2)
    stage.tp.attach(_Dropped("tp group", order))
    stage.graphs = _Dropped("graphs", order)
    stage.close()
    assert order == ["graphs", "tp group"]
    assert stage.graphs is None
