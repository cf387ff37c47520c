"""Imports go one way (docs/architecture.md, Package layout): cli/server/train -> engine -> runtime -> stage ->
{speculative, model} -> plan/config. MAY_IMPORT lists, for each top-level package, the pipespec
packages it may import; the test reads every module's import statements (function-level ones
included) and fails on an import the map does not allow, on a map that is not a layering (a cycle),
on the engine or the runtime being allowed model code, and on a cycle between modules."""
from __future__ import annotations

import ast
from pathlib import Path

import pipespec

ROOT = Path(pipespec.__file__).parent

# The data everything passes around, and the small helpers beside it: any package may import these
# (among themselves: config, sampling, parallel <- placement, plan).
DATA = {"config", "sampling", "parallel", "placement", "plan"}

MAY_IMPORT = {
    "config": set(), "sampling": set(), "parallel": set(),
    "placement": {"config"},                     # device and dtype, resolved from the config
    "plan": {"config", "sampling"},
    "kernels": DATA,
    "model": DATA | {"kernels"},
    # finding a checkpoint and reading its config and tokenizer; its weights through model's readers
    "checkpoint": DATA | {"model"},
    "heads": DATA | {"checkpoint", "model"},     # the bundled MTP heads
    "speculative": DATA | {"kernels", "model", "heads"},
    "stage": DATA | {"kernels", "model", "speculative", "checkpoint"},
    # moves plans and tensors between processes: knows no models
    "runtime": DATA,
    # knows plans and results, not models: it resolves the checkpoint and hands stages their factory
    "engine": DATA | {"checkpoint", "runtime", "stage"},
    "": DATA | {"engine"},                       # the package root re-exports the engine's API
    "server": DATA | {"", "engine"},
    "bench": DATA | {"", "engine"},
    "train": DATA | {"", "engine", "checkpoint", "heads", "model", "speculative"},
    "cli": DATA | {"", "engine", "runtime", "server", "bench", "train", "checkpoint"},
    "__main__": {"cli"},
}
# what the model is made of: DESIGN keeps it out of the engine and the runtime
MODEL_CODE = {"model", "kernels", "speculative", "heads"}


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(p for p in parts if p != "__init__")
        out[name] = path
    return out


def _imports(path: Path, module: str, mods: dict[str, Path] | None = None) -> set[str]:
    """pipespec modules (dotted, without the 'pipespec.' prefix) that `path` imports."""
    mods = _modules() if mods is None else mods
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
    mods = _modules()
    return {m: _imports(p, m, mods) for m, p in mods.items()}


def test_every_package_is_in_the_map():
    packages = {_layer(m) for m in _modules()}
    assert packages == set(MAY_IMPORT), (f"not in MAY_IMPORT: {packages - set(MAY_IMPORT)}; "
                                         f"in it, but no package: {set(MAY_IMPORT) - packages}")


def test_imports_follow_the_map():
    bad = []
    for module, deps in _graph().items():
        for dep in deps:
            a, b = _layer(module), _layer(dep)
            if a != b and b not in MAY_IMPORT[a]:
                bad.append(f"{module} -> {dep}")
    assert not bad, "imports the layering does not allow: " + ", ".join(sorted(bad))


def test_the_map_is_a_layering():
    """No cycle among packages: each can be placed above everything it may import."""
    placed: list[str] = []
    left = dict(MAY_IMPORT)
    while left:
        ready = sorted(p for p, deps in left.items() if set(deps) - {p} <= set(placed))
        assert ready, f"packages that may import each other: {sorted(left)}"
        placed += ready
        for p in ready:
            del left[p]


def test_the_engine_and_the_runtime_know_no_models():
    """DESIGN: `engine` knows plans and results, not models; `runtime` knows nothing about models
    (nor stages or checkpoints: it moves what a stage factory gives it)."""
    assert not MAY_IMPORT["engine"] & MODEL_CODE
    assert not MAY_IMPORT["runtime"] & (MODEL_CODE | {"stage", "checkpoint"})


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
    """The walk finds function-level and relative imports too (so the tests above can fail)."""
    src = tmp_path / "mod.py"
    src.write_text("def f():\n    from pipespec.engine.llm_engine import LLMEngine\n"
                   "from ..model import attention\n")
    assert {"engine.llm_engine", "model.attention"} <= _imports(src, "engine.mod")
