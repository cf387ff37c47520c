"""Where a stage runs: its current CUDA device, and the check that it holds nothing on another device."""
from __future__ import annotations

import torch


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
