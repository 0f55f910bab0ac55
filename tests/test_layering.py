"""Layers import one way: the model and the ops know nothing of DSpark's scheduling or of the engines, DSpark
knows nothing of the engines, the prefix store knows nothing of the model, DSpark or the engines, and no two
modules of the package import each other, even through a chain.

Read from the source with ``ast`` rather than by importing, so the engine adapters (which need vLLM or SGLang)
are checked too, and so an import inside a function, which only runs later, counts like one at the top.
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "deepinfer_plugins"

# layer -> layers it must never import
FORBIDDEN = {
    "models": ("dspark", "vllm", "sglang"),
    "ops": ("dspark", "vllm", "sglang"),
    "dspark": ("vllm", "sglang"),
    "kvstore": ("models", "ops", "dspark", "vllm", "sglang"),
}


def module_names(root: Path) -> dict[str, Path]:
    """Dotted name -> file, for every module under root (a package is named by its __init__.py)."""
    names = {}
    for path in sorted(root.rglob("*.py")):
        parts = (root.name, *path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(parts)] = path
    return names


def _known(name: str, modules) -> str | None:
    """The longest prefix of a dotted name that is a module of ours (``a.b.attr`` -> ``a.b``)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(name: str, path: Path, modules) -> set[str]:
    """Modules of ours that this module imports, anywhere in its body, relative imports resolved."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            # ``from pkg import sub`` imports the submodule sub; ``from mod import attr`` imports mod
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        found.update(t for t in (_known(target, modules) for target in targets) if t and t != name)
    return found


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    modules = module_names(root)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def layer(name: str) -> str | None:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else None


def layer_violations(graph) -> list[str]:
    return sorted(f"{source} imports {target}" for source, targets in graph.items() for target in targets
                  if layer(target) in FORBIDDEN.get(layer(source), ()))


def find_cycle(graph) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None."""
    state, stack = {}, []  # state: 1 on the current path, 2 done

    def visit(node):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_graph_sees_relative_function_level_and_submodule_imports():
    graph = import_graph()
    assert "deepinfer_plugins.models.deepseek_v41.drafter" in graph["deepinfer_plugins.models.deepseek_v41.model"]
    assert "deepinfer_plugins.ops" in graph["deepinfer_plugins.models.deepseek_v41.drafter"]  # from ... import ops
    assert "deepinfer_plugins.sglang.patches" in graph["deepinfer_plugins.sglang.register"]  # inside a function


def test_lower_layers_never_import_higher_ones():
    assert layer_violations(import_graph()) == []


def test_no_import_cycle():
    assert find_cycle(import_graph()) is None


@pytest.mark.parametrize("graph, expected", [
    ({"p.a": {"p.b"}, "p.b": {"p.c"}, "p.c": {"p.a"}}, ["p.a", "p.b", "p.c", "p.a"]),
    ({"p.a": {"p.b"}, "p.b": set(), "p.c": {"p.b"}}, None),
])
def test_find_cycle(graph, expected):
    assert find_cycle(graph) == expected


def test_layer_rule_names_the_offending_import():
    graph = {"deepinfer_plugins.models.m": {"deepinfer_plugins.dspark.d"}, "deepinfer_plugins.dspark.d": set()}
    assert layer_violations(graph) == ["deepinfer_plugins.models.m imports deepinfer_plugins.dspark.d"]
