"""The package's shape, read from its source: imports point one way (no cycles, function-level imports counted),
imports hidden inside functions are only for optional or slow packages, and attention is computed in one place."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "llama_scratch"
# Imported inside a function on purpose, each for a reason its code states: matplotlib costs half a second at start;
# pyarrow is optional (the `parquet` extra), needed only for a Parquet file.
# Optional packages, and FSDP's (about a second of start-up that runs which shard nothing skip: sharding.py).
DEFERRED = {"matplotlib", "matplotlib.pyplot", "pyarrow.parquet"}
DEFERRED |= {"torch.distributed.device_mesh", "torch.distributed.fsdp", "torch.distributed.tensor"}


def imports() -> dict[str, tuple[set[str], set[str]]]:
    """module -> (our modules it imports anywhere, packages it imports inside functions)."""
    found = {}
    for path in sorted(PACKAGE.glob("*.py")):
        tree = ast.parse(path.read_text())
        ours, deferred = set(), set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                ours |= {node.module.split(".")[0]} if node.module else {a.name for a in node.names}
        for func in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)):
            for node in ast.walk(func):
                if isinstance(node, ast.Import):
                    deferred |= {a.name for a in node.names}
                elif isinstance(node, ast.ImportFrom):
                    deferred.add(("." * node.level) + (node.module or ""))
        found[path.stem] = (ours - {path.stem}, deferred)
    return found


def test_no_import_cycles():
    graph = {name: deps for name, (deps, _) in imports().items()}
    cycles = []

    def visit(name: str, path: list[str]) -> None:
        for dep in sorted(graph.get(name, ())):
            if dep in path:
                cycles.append(" -> ".join([*path[path.index(dep) :], dep]))
            elif len(path) < len(graph):
                visit(dep, [*path, dep])

    for name in graph:
        visit(name, [name])
    assert not cycles, cycles


def test_imports_inside_functions_are_only_the_deferred_packages():
    hidden = {name: sorted(deferred - DEFERRED) for name, (_, deferred) in imports().items() if deferred - DEFERRED}
    assert not hidden, hidden


def test_one_place_computes_attention():
    calls = [
        f"{path.name}:{node.lineno}"
        for path in sorted(PACKAGE.glob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Attribute) and node.attr == "scaled_dot_product_attention"
    ]
    assert len(calls) == 1 and calls[0].startswith("model.py"), calls
