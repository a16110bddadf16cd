"""The one state-dict tree walker: nested dicts, lists and tuples, leaves replaced or collected."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from typing import Any, Literal

Path = tuple[Any, ...]


def iter_tree(tree: Any, pick: Callable[[Any], Any]) -> Iterator[Any]:
    """``pick(node)`` of every node for which it is not None, in order; below such a node nothing
    is visited. Containers are dicts (their values), lists and tuples."""
    found = pick(tree)
    if found is not None:
        yield found
    elif isinstance(tree, dict):
        for value in tree.values():
            yield from iter_tree(value, pick)
    elif isinstance(tree, (list, tuple)):
        for value in tree:
            yield from iter_tree(value, pick)


def map_tree(
    tree: Any,
    leaf: Callable[[Any, Path], Any],
    *,
    rebuild: Literal["changed", "always"] = "changed",
    path: Path = (),
) -> Any:
    """``tree`` with each value other than a dict, list or tuple replaced by ``leaf(value, path)``.

    The original is never mutated. ``rebuild="changed"`` returns a container whose values all
    came back as they were (``is``) as it is, so untouched subtrees keep their identity, and
    builds the others anew: ``type(d)()`` filled for a dict (a plain ``{}`` for a ``dict``), the
    type called on the items for a list or tuple (a namedtuple's positionally).
    ``rebuild="always"`` copies every container: ``copy.copy`` of a dict, then each key set; a
    new ``list`` for a list; a tuple as above. ``path`` is the keys and indices from the root.
    """
    if isinstance(tree, dict):
        if rebuild == "always":
            new = copy.copy(tree)
            for key, value in tree.items():
                new[key] = map_tree(value, leaf, rebuild=rebuild, path=(*path, key))
            return new
        values = {
            key: map_tree(value, leaf, rebuild=rebuild, path=(*path, key))
            for key, value in tree.items()
        }
        if all(values[key] is tree[key] for key in tree):
            return tree
        out = type(tree)() if type(tree) is not dict else {}
        out.update(values)
        return out
    if isinstance(tree, (list, tuple)):
        items = [
            map_tree(value, leaf, rebuild=rebuild, path=(*path, i)) for i, value in enumerate(tree)
        ]
        if rebuild == "always" and isinstance(tree, list):
            return items
        if rebuild == "changed" and all(a is b for a, b in zip(items, tree, strict=True)):
            return tree
        if hasattr(tree, "_fields"):  # a namedtuple takes its fields positionally
            return type(tree)(*items)
        return type(tree)(items)
    return leaf(tree, path)
