"""The package's imports read from source, for the layout, docs and report tests.

One parser of import statements (relative ones resolved, imports inside functions included), the
package's import graph and its circles, and the list of public modules.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: The modules whose ``__all__`` is the documented API (docs/api.md); every other module of the
#: package has no ``__all__``.
PUBLIC_MODULES = (
    "te_ckpt_placement",
    "te_ckpt_placement.dcp",
    "te_ckpt_placement.integrations",
    "te_ckpt_placement.integrations.hf",
    "te_ckpt_placement.integrations.lightning",
    "te_ckpt_placement.integrations.pytorch_lightning",
    "te_ckpt_placement.integrations.automodel",
    "te_ckpt_placement.integrations.torchtitan",
    "te_ckpt_placement.integrations.megatron",
)


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(test: ast.expr) -> bool:
    return ast.unparse(test) in {"TYPE_CHECKING", "typing.TYPE_CHECKING"}


def imports(
    path: Path, root: Path = ROOT, *, runtime_only: bool = False
) -> list[tuple[int, str, list[str]]]:
    """(line, absolute module, imported names) of every import statement in ``path``;
    ``runtime_only`` leaves out the imports under ``if TYPE_CHECKING:`` (they never run)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    skipped = (
        {
            id(inner)
            for node in ast.walk(tree)
            if isinstance(node, ast.If) and _is_type_checking(node.test)
            for stmt in node.body
            for inner in ast.walk(stmt)
        }
        if runtime_only
        else set()
    )
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: list[tuple[int, str, list[str]]] = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            found.append((node.lineno, module, [alias.name for alias in node.names]))
    return found


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Each module of the package under ``root`` -> the package modules it imports, inside
    functions too; ``TYPE_CHECKING``-only imports are left out (they never run).
    ``from pkg import mod`` counts as importing ``mod``, not ``pkg``."""
    paths = sorted((root / "te_ckpt_placement").rglob("*.py"))
    modules = {module_name(p, root) for p in paths}
    graph: dict[str, set[str]] = {}
    for path in paths:
        found: set[str] = set()
        for _, module, names in imports(path, root, runtime_only=True):
            subs = {f"{module}.{name}" for name in names} & modules
            found |= subs or {module}
        graph[module_name(path, root)] = found & modules
    return graph


def import_cycles(graph: dict[str, set[str]]) -> set[tuple[str, ...]]:
    """Every import circle of ``graph``: its strongly connected components, each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: set[tuple[str, ...]] = set()

    def visit(node: str) -> None:  # Tarjan's algorithm
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1 or node in graph.get(node, ()):
                cycles.add(tuple(sorted(component)))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles
