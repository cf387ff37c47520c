"""Eager launches of Triton kernels with less host time: `@cached_launch` over `@triton.jit` (or
`@gluon.jit`) keeps `kernel[grid](*args, **meta)` as it is and looks the compiled kernel up by a key
of its own, then calls its launcher directly.

Why: an eager step (prefill, or any step not replayed from a CUDA graph) launches every kernel from
Python, and the JIT's own launch path binds and specializes every argument and hashes every
constexpr (Gluon layouts rebuild tuples to hash) at each call, several times the compiled
launcher's own host time (RESULTS.md), and a 32-layer prefill makes ~500 such launches.

The key holds what the JIT specializes on, read cheaply: each tensor's dtype and 16-byte alignment,
each integer's 1 / multiple-of-16 / width class, and the constexprs and launch options (plain values
as they are; other objects, such as layouts, by identity, pinned by the entry so that an identity is
never reused). It may be finer than the JIT's key, never coarser: a miss launches through the JIT,
which compiles or finds the right kernel, and the entry remembers what it returned. Anything the key
does not describe (a callable grid, an argument of another type, a launch hook set by a profiler)
takes the JIT's path every time, as does the interpreter (`TRITON_INTERPRET=1`).
"""
from __future__ import annotations

import torch

from pipespec.kernels import HAVE_TRITON

if HAVE_TRITON:     # the keys below are plain Python, tested without Triton
    from triton import knobs
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

_PLAIN = {int, float, bool, str, type(None), torch.dtype}
MAX_ENTRIES = 256       # a kernel keyed on fresh objects at every call stops caching there


def arg_key(args: tuple) -> tuple | None:
    """The positional arguments' part of the key, flat (the hit path builds it at every launch), or
    None when one is of a type it does not describe. A tensor adds its dtype and its address mod 16;
    an integer a code >= 16 for what the JIT specializes it on (1, a multiple of 16, 32 / 64 / more
    bits); bool, float and None their type (not specialized). A dtype starts every tensor's pair, so
    no two argument lists share a key."""
    key = []
    for a in args:
        t = type(a)
        if t is torch.Tensor:
            key += (a.dtype, a.data_ptr() & 15)
        elif t is int:
            key.append(16 + (a == 1) + 2 * (a % 16 == 0)
                       + (4 if -2 ** 31 <= a < 2 ** 31 else 8 if -2 ** 63 <= a < 2 ** 63 else 12))
        elif t is bool or t is float or a is None:
            key.append(t)
        elif isinstance(a, torch.Tensor):                   # a Parameter
            key += (a.dtype, a.data_ptr() & 15)
        else:
            return None
    return tuple(key)


def meta_key(meta: dict) -> tuple:
    """Constexprs and launch options, names then values: plain values as they are, other objects
    (Gluon layouts, whose hash rebuilds tuples) by identity."""
    return (*meta, *[v if type(v) in _PLAIN else id(v) for v in meta.values()])


def _hooked() -> bool:
    """Whether a launch hook is set (a profiler's): those launches take the JIT's path. Triton 3.6
    keeps a chain of hooks (empty: none set) where older versions keep None or the hook itself."""
    enter, leave = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
    return bool(getattr(enter, "calls", enter)) or bool(getattr(leave, "calls", leave))


class CachedLaunch:
    """A launched kernel: `kernel[grid](*args, **meta)` with the compiled kernel cached per key."""

    def __init__(self, fn):
        self.fn = fn
        self.jit = isinstance(fn, JITFunction)              # False under the interpreter
        self._entries: dict[tuple, tuple] = {}
        self.hits = 0                                       # launches that skipped the JIT's path
        if self.jit:
            self._names = fn.arg_names
            self._defaults = {p.name: p.default for p in fn.params}

    def __getitem__(self, grid):
        return lambda *args, **meta: self.launch(grid, args, meta)

    def launch(self, grid, args: tuple, meta: dict):
        if not self.jit or _hooked() or type(grid) is not tuple:
            return self.fn[grid](*args, **meta)
        a = arg_key(args)
        if a is None:
            return self.fn[grid](*args, **meta)
        device = driver.active.get_current_device()
        key = (device, a, meta_key(meta))
        entry = self._entries.get(key)
        if entry is None:
            compiled = self.fn[grid](*args, **meta)
            if len(self._entries) < MAX_ENTRIES:
                tail = tuple((n, self._defaults[n]) for n in self._names[len(args):])
                self._entries[key] = (compiled, compiled.run, tail, meta)
            return compiled
        compiled, run, tail, _ = entry
        self.hits += 1
        grid = grid + (1,) * (3 - len(grid))
        run(grid[0], grid[1], grid[2], driver.active.get_current_stream(device), compiled.function,
            compiled.packed_metadata, None, None, None, *args, *[meta.get(n, d) for n, d in tail])
        return compiled


def cached_launch(fn) -> CachedLaunch:
    return CachedLaunch(fn)
