"""Where a stage runs: its current CUDA device, its attention backend, the CPU weight layout, and
the check that it holds nothing on another device."""
from __future__ import annotations

import logging
import time

import torch

from pipespec import kernels
from pipespec.model.attention import AttentionBackend, TorchReferenceBackend
from pipespec.model.layers import LMHead
from pipespec.parallel import TensorParallel

logger = logging.getLogger(__name__)


def use_device(device: torch.device) -> torch.device:
    """Make `device` this process's current CUDA device, and return it with its index.

    Triton launches, CUDA graph capture, events and pinned host buffers all act on the *current*
    device, not on the device of the tensors involved: a stage on cuda:1 in a process whose current
    device is cuda:0 fails at its first kernel ("cannot be accessed from Triton"). Each stage process
    runs one stage, so it sets its device once, before it builds anything.
    """
    if device.type != "cuda":
        return device
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.set_device(device)
    return device


def finish_within(timeout: float, tp: TensorParallel, what: str) -> None:
    """Wait, at most `timeout` seconds, for the work enqueued on the current CUDA stream.

    A collective captured in a CUDA graph is not watched by NCCL's watchdog: if a TP peer dies
    during a replay, the replay never ends, and a plain host sync (the result's copy to the host)
    would block for ever. So a TP stage on CUDA polls an event instead; past the timeout it aborts the
    TP communicator (which ends the stuck kernel) and raises, and the runtime reports the stage.
    """
    done = torch.cuda.Event()
    done.record()
    deadline = time.monotonic() + timeout
    while not done.query():
        if time.monotonic() > deadline:
            tp.abort()
            raise TimeoutError(f"{what} did not finish on the GPU within {timeout:g}s (a tensor-parallel peer "
                               "died or stopped?)")
        time.sleep(0)


def choose_backend(choice: str, device: torch.device, model=None) -> AttentionBackend:
    """The attention backend for `choice` ("auto", "torch", "triton") on `device`, for `model` (a
    family may run on the torch backend only: `reference_attention_only`)."""
    if model is not None and model.reference_attention_only:
        if choice == "triton":
            raise ValueError(f"attention_backend='triton' does not serve {model.arch.model_type} (DeepSeek sparse "
                             "attention runs on the torch backend); use attention_backend='auto' or 'torch'")
        if device.type == "cuda":
            logger.info("%s: sparse attention runs on the torch attention backend (eager, no CUDA graphs)",
                        model.arch.model_type)
        return TorchReferenceBackend()
    can_triton = device.type == "cuda" and kernels.HAVE_TRITON
    if choice == "triton" and not can_triton:
        raise ValueError(f"attention_backend='triton' needs a CUDA device and the triton package; "
                         f"this stage runs on {device} (triton installed: {kernels.HAVE_TRITON})")
    if choice == "triton" or (choice == "auto" and can_triton):
        from pipespec.model.triton_backend import TritonPagedBackend
        return TritonPagedBackend()
    return TorchReferenceBackend()


def prefer_column_major(module: torch.nn.Module) -> None:
    """Store every layer's [out, in] matrix transposed in memory (same values, same shape).

    On CPU, MKL's matrix-vector product reads such a layout faster, and batch-1 decode is made of
    them (RESULTS.md). Embeddings and LM heads stay row-major: lookups want rows, and `head_logits`
    is fastest on a row-major head at any row count.
    """
    for m in module.modules():
        if isinstance(m, torch.nn.Linear) and not isinstance(m, LMHead):
            m.weight.data = m.weight.data.t().contiguous().t()


def tensors_off_device(obj, device: torch.device, path: str = "stage", seen: set | None = None) -> list[str]:
    """Paths of the tensors `obj` holds (modules, pipespec objects, lists, dicts) that are not on
    `device`: a cheap check that a stage holds nothing on a device but its own. Host mirrors an object
    names in `host_buffers` (pinned upload buffers) are meant to be on the CPU."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return []
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        same = obj.device.type == device.type and (device.index is None or obj.device.index == device.index)
        return [] if same else [f"{path} on {obj.device}"]
    if isinstance(obj, torch.nn.Module):
        items = (list(obj.named_parameters(recurse=False)) + list(obj.named_buffers(recurse=False))
                 + list(obj.named_children()) + [(k, v) for k, v in vars(obj).items() if not k.startswith("_")])
    elif isinstance(obj, (list, tuple)):
        items = list(enumerate(obj))
    elif isinstance(obj, dict):
        items = list(obj.items())
    elif type(obj).__module__.startswith("pipespec") and hasattr(obj, "__dict__"):
        items = list(vars(obj).items())
    else:
        return []
    host = set(getattr(obj, "host_buffers", ()))
    return [bad for name, value in items if name not in host
            for bad in tensors_off_device(value, device, f"{path}.{name}", seen)]
