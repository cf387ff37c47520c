"""Imports go one way (docs/architecture.md, Package layout): cli/server/train -> engine -> runtime -> stage ->
{speculative, model} -> plan/config. The test reads every module's import statements (function-level
ones included) and fails on an upward import, on the runtime touching models, and on a cycle."""
from __future__ import annotations

import ast
from pathlib import Path

import pipespec

ROOT = Path(pipespec.__file__).parent

# higher layers may import lower ones, never the reverse
LAYERS = {
    "config": 0, "sampling": 0, "plan": 0, "layout": 0, "parallel": 0,
    "kernels": 1,
    "model": 2,
    "heads": 3,
    "speculative": 4,
    "stage": 5,
    "runtime": 6,
    "engine": 7, "": 7,            # the package root re-exports the engine's public API (LLM, SamplingParams)
    "server": 8, "train": 8, "bench": 8,
    "cli": 9, "__main__": 10,
}
# the runtime moves plans and tensors between processes: it knows no models
FORBIDDEN = {"runtime": {"model", "kernels", "speculative", "stage", "heads"}}


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(p for p in parts if p != "__init__")
        out[name] = path
    return out


def _imports(path: Path, module: str) -> set[str]:
    """pipespec modules (dotted, without the 'pipespec.' prefix) that `path` imports."""
    mods = _modules()
    found = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name == "pipespec" or a.name.startswith("pipespec.")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1] if package else []
                target = ".".join(["pipespec", *base, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            if target == "pipespec" or target.startswith("pipespec."):
                for alias in node.names:   # `from pipespec.x import y`: the module y, else x itself
                    sub = f"{target}.{alias.name}"
                    found.add(sub if sub.removeprefix("pipespec.") in mods else target)
    out = set()
    for name in found:
        short = name.removeprefix("pipespec").lstrip(".")
        while short not in mods and "." in short:
            short = short.rpartition(".")[0]
        if short in mods and short != module:
            out.add(short)
    return out


def _layer(module: str) -> str:
    return module.split(".")[0]


def _graph() -> dict[str, set[str]]:
    return {m: _imports(p, m) for m, p in _modules().items()}


def test_every_top_level_module_has_a_layer():
    assert {_layer(m) for m in _modules()} <= set(LAYERS), set(map(_layer, _modules())) - set(LAYERS)


def test_no_upward_imports():
    bad = []
    for module, deps in _graph().items():
        for dep in deps:
            a, b = _layer(module), _layer(dep)
            if a != b and (LAYERS[b] > LAYERS[a] or b in FORBIDDEN.get(a, ())):
                bad.append(f"{module} -> {dep}")
    assert not bad, "imports against the layering: " + ", ".join(sorted(bad))


def test_no_import_cycles():
    graph = _graph()
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for dep in sorted(graph[m]):
            if state.get(dep) == 1:
                cycles.append(" -> ".join(stack[stack.index(dep):] + [dep]))
            elif dep not in state:
                visit(dep)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert not cycles, "import cycles: " + " | ".join(cycles)


def test_the_checker_sees_a_violation(tmp_path):
    """The walk finds function-level imports too (so the tests above can fail)."""
    src = tmp_path / "mod.py"
    src.write_text("def f():\n    from pipespec.engine.llm_engine import LLMEngine\n")
    assert "engine.llm_engine" in _imports(src, "runtime.mod")
