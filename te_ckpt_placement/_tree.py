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
    copy_changed: bool = False,
    path: Path = (),
) -> Any:
    """``tree`` with each value other than a dict, list or tuple replaced by ``leaf(value, path)``.

    The original is never mutated. ``rebuild="changed"`` returns a container whose values all
    came back as they were (``is``) as it is, so untouched subtrees keep their identity, and
    builds the others anew: ``type(d)()`` filled for a dict (a plain ``{}`` for a ``dict``), the
    type called on the items for a list or tuple (a namedtuple's positionally); with
    ``copy_changed`` a rebuilt dict or list is instead a ``copy.copy`` of the original with the
    changed values set (what a subclass keeps besides its items, a defaultdict's factory, stays).
    ``rebuild="always"`` copies every container: ``copy.copy`` of a dict, then each key set; a
    new ``list`` for a list; a tuple as above. ``path`` is the keys and indices from the root.
    """

    def below(value: Any, key: Any) -> Any:
        return map_tree(value, leaf, rebuild=rebuild, copy_changed=copy_changed, path=(*path, key))

    if isinstance(tree, dict):
        if rebuild == "always":
            new = copy.copy(tree)
            for key, value in tree.items():
                new[key] = below(value, key)
            return new
        values = {key: below(value, key) for key, value in tree.items()}
        changed = [key for key in tree if values[key] is not tree[key]]
        if not changed:
            return tree
        if copy_changed:
            new = copy.copy(tree)
            for key in changed:
                new[key] = values[key]
            return new
        out = type(tree)() if type(tree) is not dict else {}
        out.update(values)
        return out
    if isinstance(tree, (list, tuple)):
        items = [below(value, i) for i, value in enumerate(tree)]
        if rebuild == "always" and isinstance(tree, list):
            return items
        if rebuild == "changed" and all(a is b for a, b in zip(items, tree, strict=True)):
            return tree
        if copy_changed and isinstance(tree, list):
            new_list = copy.copy(tree)
            new_list[:] = items
            return new_list
        if hasattr(tree, "_fields"):  # a namedtuple takes its fields positionally
            return type(tree)(*items)
        return type(tree)(items)
    return leaf(tree, path)
