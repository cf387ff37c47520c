"""Programmatic dependent launch (`kernels/pdl.py`): on only inside `pdl_scope` (the CUDA-graph
capture) on an sm_90+ GPU; and a chain of PDL kernels whose every input is the previous kernel's
output (norm -> GEMV with split-K sums -> gated GEMV -> norm ...), replayed from a CUDA graph with
PDL on, gives bit for bit what it gives with PDL off (a kernel that read its input or stored before
its wait would read stale rows on some replays); and every PDL kernel's source waits first thing."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from tests.kernels import INTERPRET

from pipespec.kernels import in_pdl_scope, pdl_scope

SM90 = not INTERPRET and torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


def _pdl_on():
    return pytest.importorskip("pipespec.kernels.pdl", reason="needs triton").pdl_on


def test_the_scope_is_set_inside_only_and_reset_after_an_error():
    assert not in_pdl_scope()
    with pytest.raises(RuntimeError):
        with pdl_scope():
            assert in_pdl_scope()
            raise RuntimeError
    assert not in_pdl_scope()


def test_pdl_is_off_outside_the_scope_and_where_it_cannot_run(monkeypatch):
    pdl_on = _pdl_on()
    with pdl_scope():
        assert not pdl_on(torch.device("cpu"))
    if SM90:
        assert not pdl_on(torch.device("cuda"))              # an eager launch
        with pdl_scope():
            assert pdl_on(torch.device("cuda"))
            monkeypatch.setenv("PIPESPEC_PDL", "0")
            assert not pdl_on(torch.device("cuda"))


def _chain(x, weights, norm):
    from pipespec.kernels.fused_ops import rms_norm
    from pipespec.kernels.gemv import rowmajor_gemv
    residual = torch.zeros_like(x)
    for w_in, w_out in weights:
        h, residual = rms_norm(x, norm, 1e-6, residual)
        x = rowmajor_gemv(rowmajor_gemv(h, w_in), w_out, gated=True)
    return x


@pytest.mark.gpu(capability=9)
def test_a_pdl_chain_replayed_from_a_graph_equals_the_plain_one(monkeypatch):
    from pipespec.stage.cuda_graphs import capture_graph
    pdl_on = _pdl_on()
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden, inter = 1024, 2816                          # the down projection splits K (a sum kernel)
    weights = [((torch.randn(2 * inter, hidden, device="cuda", generator=g) * 0.03).bfloat16(),
                (torch.randn(hidden, inter, device="cuda", generator=g) * 0.03).bfloat16()) for _ in range(12)]
    norm = torch.ones(hidden, device="cuda", dtype=torch.bfloat16)
    x = torch.zeros(1, hidden, device="cuda", dtype=torch.bfloat16)
    outs = {}
    for pdl in ("0", "1"):
        monkeypatch.setenv("PIPESPEC_PDL", pdl)
        with pdl_scope():
            assert pdl_on(x.device) == (pdl == "1")
        graph, out = capture_graph(None, lambda: _chain(x, weights, norm))     # as the engine captures
        results = []
        for seed in range(20):                          # a new input each replay: stale reads would show
            x.copy_(torch.randn(1, hidden, device="cuda", generator=torch.Generator(device="cuda").manual_seed(seed)))
            graph.replay()
            results.append(out.clone())
        outs[pdl] = torch.stack(results)
    assert outs["0"].abs().sum() > 0
    assert torch.equal(outs["0"], outs["1"])



def _pdl_kernels():
    """(file, kernel) of every Triton kernel in pipespec/kernels that takes the `PDL` constexpr."""
    import pipespec.kernels
    for path in sorted(Path(pipespec.kernels.__file__).parent.glob("*.py")):
        if path.name in ("pdl.py", "pdl_gluon.py"):           # the helpers themselves
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and any(a.arg == "PDL" for a in node.args.args) \
                    and any("jit" in ast.unparse(d) for d in node.decorator_list):
                yield path.name, node


def _leading_calls(kernel: ast.FunctionDef, n: int) -> list[str]:
    """Names of the functions called by the kernel's first n statements after its docstring."""
    body = kernel.body
    if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    return [ast.unparse(s.value.func) if isinstance(s, ast.Expr) and isinstance(s.value, ast.Call) else ast.unparse(s)
            for s in body[:n]]


def test_every_pdl_kernel_waits_before_anything_else():
    """The invariant PDL's correctness rests on (`kernels/pdl.py`): a kernel's first statements
    (after its docstring) are its wait, optionally after its signal; nothing is read or stored
    before the kernel before it has completed."""
    kernels = list(_pdl_kernels())
    assert len(kernels) >= 15, [k.name for _, k in kernels]    # the decode path's kernels are found
    for file, kernel in kernels:
        first = _leading_calls(kernel, 2)
        assert first[:1] == ["pdl_wait"] or first == ["pdl_signal", "pdl_wait"], \
            f"{file}::{kernel.name} must wait (pdl_wait(PDL)) before anything else; it starts {first}"
