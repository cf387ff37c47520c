"""`kernels/launch.py`: the key of a cached eager launch separates what the JIT specializes on (CPU),
and a launch served from the cache computes what the JIT's own launch does (GPU: the compiled path
exists only there; the interpreter takes the JIT's path)."""
from __future__ import annotations

import pytest
import torch

from pipespec.kernels.launch import arg_key, meta_key
from pipespec.model.quant.packed import Fp8Weight
from tests.kernels import rel
from tests.model.quant import writers



def test_the_key_separates_alignment_dtype_and_integer_classes():
    buf = torch.zeros(64, dtype=torch.bfloat16)
    aligned, misaligned = buf[:16], buf[1:17]                # 2 bytes off: not 16-byte aligned
    assert arg_key((aligned,)) != arg_key((misaligned,))
    assert arg_key((aligned,)) != arg_key((aligned.float(),))
    assert arg_key((aligned,)) == arg_key((buf[8:24],))      # 16 bytes on: the same kernel
    ints = [arg_key((v,)) for v in (1, 2, 16, 2 ** 31, 2 ** 64)]
    assert len(set(ints)) == len(ints)
    assert arg_key((3,)) == arg_key((5,)) and arg_key((32,)) == arg_key((48,))
    assert arg_key((0.5,)) == arg_key((2.0,)) and arg_key((True,)) == arg_key((False,))
    assert arg_key((True,)) != arg_key((1,)) and arg_key((None,)) != arg_key((0,))
    assert arg_key(((1, 2),)) is None                        # not described: the JIT's path


def test_constexprs_key_by_value_or_identity():
    layout, same = [[0, 1]], [[0, 1]]                        # equal, not the same object
    assert meta_key({"BLOCK": 64, "dt": torch.bfloat16, "asm": "mov"}) == \
        meta_key({"BLOCK": 64, "dt": torch.bfloat16, "asm": "mov"})
    assert meta_key({"BLOCK": 64}) != meta_key({"BLOCK": 128})
    assert meta_key({"L": layout}) == meta_key({"L": layout})
    assert meta_key({"L": layout}) != meta_key({"L": same})


def _weights(device):
    w = torch.randn(512, 1024, generator=torch.Generator().manual_seed(1))
    int4, ref4 = writers.packed_int4(w, "awq", group=128, seed=2)
    t, ref8 = writers.fp8(w, (128, 128))
    fp8 = Fp8Weight(t["weight"], t["weight_scale_inv"], (128, 128))
    return [(int4.to(device), ref4.to(device)), (fp8.to(device), ref8.to(device))]


@pytest.mark.gpu             # the compiled launch path exists only there (the interpreter takes the JIT's)
@pytest.mark.parametrize("m", [1, 16])
def test_a_cached_launch_computes_what_the_jit_launch_does(m):
    from pipespec.kernels import fp8_mma, gemv, int4_mma
    device = torch.device("cuda")
    buf = torch.randn(2 * m * 1024 + 8, device=device, dtype=torch.bfloat16)
    kernels = (int4_mma._int4_mma_kernel, fp8_mma._fp8_mma_kernel, gemv._rowmajor_gemv_kernel, gemv._sum_splits)
    with torch.inference_mode():
        for packed, ref in _weights(device):
            for offset in (0, 1, 0):                    # aligned, misaligned (a kernel of its own), aligned again
                for seed in range(3):
                    x = buf[offset:offset + m * 1024].view(m, 1024)
                    x.copy_(torch.randn(m, 1024, generator=torch.Generator().manual_seed(seed)))
                    hits = sum(k.hits for k in kernels)
                    got = packed.matmul(x)
                    assert rel(got, x.float() @ ref.t()) < 2e-2
                    if seed:                            # the first call of a key may compile: later ones hit
                        assert sum(k.hits for k in kernels) > hits


@pytest.mark.gpu             # the compiled launch path exists only there (the interpreter takes the JIT's)
def test_a_profilers_launch_hook_sees_every_launch():
    """With a launch hook set (proton's, say) launches take the JIT's path, which calls the hook."""
    from triton import knobs
    from pipespec.kernels import fused_ops
    x = torch.randn(4, 256, device="cuda", dtype=torch.bfloat16)
    seen = []
    with torch.inference_mode():
        want = fused_ops.silu_mul(x)                        # compiled and cached
        fused_ops.silu_mul(x)
        hits = fused_ops._silu_mul_kernel.hits
        knobs.runtime.launch_enter_hook.add(seen.append)
        try:
            got = fused_ops.silu_mul(x)
        finally:
            knobs.runtime.launch_enter_hook.remove(seen.append)
        assert len(seen) == 1 and fused_ops._silu_mul_kernel.hits == hits and torch.equal(got, want)
        fused_ops.silu_mul(x)
        assert fused_ops._silu_mul_kernel.hits == hits + 1
