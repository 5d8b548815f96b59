"""The package's shape, read from its source: imports point one way (no cycles, function-level imports counted),
imports hidden inside functions are only for optional or slow packages, and attention is computed in one place."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "llama_scratch"
# Imported inside a function on purpose, each for a reason its code states: matplotlib costs half a second at start;
# pyarrow is optional (the `parquet` extra), needed only for a Parquet file.
# Optional packages, and FSDP's (about a second of start-up that runs which shard nothing skip: sharding.py).
DEFERRED = {"matplotlib", "matplotlib.pyplot", "pyarrow.parquet"}
DEFERRED |= {"torch.distributed.device_mesh", "torch.distributed.fsdp", "torch.distributed.tensor"}
# gguf: only converting a GGUF file needs it; a machine without it (the lent GPU) still imports everything else.
DEFERRED |= {"gguf", "gguf.constants"}
# tensorboard: an optional extra, imported only under --tensorboard (training/board.py).
DEFERRED |= {"torch.utils.tensorboard"}


def module_name(path: Path) -> str:
    """llama_scratch/model/llama.py -> model.llama (a folder's __init__.py -> the folder)."""
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports() -> dict[str, tuple[set[str], set[str]]]:
    """module -> (our modules it imports anywhere, packages it imports inside functions)."""
    found = {}
    modules = {module_name(p) for p in PACKAGE.rglob("*.py")}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = module_name(path)
        here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        tree = ast.parse(path.read_text())
        ours, deferred = set(), set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level:
                base = ".".join([*here[: len(here) - node.level + 1], *([node.module] if node.module else [])])
                targets = [f"{base}.{a.name}".lstrip(".") for a in node.names] + [base]
                ours |= {t for t in targets if t in modules}
        for func in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)):
            for node in ast.walk(func):
                if isinstance(node, ast.Import):
                    deferred |= {a.name for a in node.names}
                elif isinstance(node, ast.ImportFrom):
                    deferred.add(("." * node.level) + (node.module or ""))
        found[name] = (ours - {name}, deferred)
    return found


def folder(module: str) -> str:
    """The layer a module is in: its folder, or 'top' for the commands, __main__ and the package's __init__."""
    first = module.split(".")[0]
    return first if first and (PACKAGE / first).is_dir() else "top"


def find_cycles(graph: dict[str, set[str]]) -> list[str]:
    cycles = []

    def visit(name: str, path: list[str]) -> None:
        for dep in sorted(graph.get(name, ())):
            if dep in path:
                cycles.append(" -> ".join([*path[path.index(dep) :], dep]))
            elif len(path) < len(graph):
                visit(dep, [*path, dep])

    for name in graph:
        visit(name, [name])
    return cycles


def test_no_import_cycles_between_modules_or_folders():
    graph = {name: deps for name, (deps, _) in imports().items()}
    assert not find_cycles(graph)
    folders: dict[str, set[str]] = {}
    for name, deps in graph.items():
        folders.setdefault(folder(name), set()).update(folder(d) for d in deps if folder(d) != folder(name))
    assert not find_cycles(folders), folders
    assert not [f for f, deps in folders.items() if f != "top" and "top" in deps], "a folder imports a command"


def test_torch_distributed_is_imported_in_the_parallel_folder_only():
    outside = [
        module_name(path)
        for path in PACKAGE.rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Import | ast.ImportFrom)
        and any(
            n.startswith("torch.distributed")
            for n in [getattr(node, "module", None) or ""] + [a.name for a in node.names]
        )
        and not module_name(path).startswith("parallel")
    ]
    assert not outside, outside


def test_imports_inside_functions_are_only_the_deferred_packages():
    hidden = {name: sorted(deferred - DEFERRED) for name, (_, deferred) in imports().items() if deferred - DEFERRED}
    assert not hidden, hidden


def test_one_place_computes_attention():
    """One call of the fused kernel, in the module that chooses which kernel serves it (`attention_kernels.sdpa`,
    which `model.llama.Attention` calls)."""
    calls = [
        f"{module_name(path)}:{node.lineno}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Attribute) and node.attr == "scaled_dot_product_attention"
    ]
    assert len(calls) == 1 and calls[0].startswith("model.attention_kernels:"), calls
