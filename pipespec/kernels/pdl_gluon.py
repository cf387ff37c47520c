"""`kernels/pdl.py`'s wait and signal for Gluon kernels (`kernels/int4_mma.py`): the same PTX, the
same rule (a PDL kernel waits first thing, before it reads or stores anything)."""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl


@gluon.jit
def pdl_signal(PDL: gl.constexpr):
    if PDL:
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [], dtype=gl.int32,
                                  is_pure=False, pack=1)


@gluon.jit
def pdl_wait(PDL: gl.constexpr):
    if PDL:
        gl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], dtype=gl.int32, is_pure=False,
                                  pack=1)
