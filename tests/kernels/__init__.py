"""What the kernel tests share: they run on a GPU, or on CPU under the Triton interpreter
(TRITON_INTERPRET=1 with triton installed), which is how the kernels are developed without one."""
import pytest
import torch

from tests.helpers import INTERPRET  # noqa: F401  (the kernel tests' one import of it)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ON_KERNELS = pytest.mark.gpu(interpret=True)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative error of a against b, in norm (float32)."""
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def shape_id(shape: dict | None) -> str:
    """A test id for a decode kernel's launch shape (None: the default)."""
    return "default" if shape is None else "n{block_n}_k{block_k}_w{num_warps}_split{split_k}".format(**shape)


def rows_reaching(monkeypatch, module, name: str) -> list[int]:
    """The row counts of x (the first argument) in each call of module.name from now on: which path
    served a product."""
    calls, run = [], getattr(module, name)
    monkeypatch.setattr(module, name, lambda x, *a, **k: calls.append(x.shape[0]) or run(x, *a, **k))
    return calls
