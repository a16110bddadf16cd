"""The torch-only leaf helpers: the one tree walker, version lookup and local-tensor helper."""

from __future__ import annotations

import ast
import collections
import sys
import types
from typing import Any, NamedTuple

import pytest
import torch

from te_ckpt_placement._te_contract import te_version
from te_ckpt_placement._tree import iter_tree, map_tree
from te_ckpt_placement._versions import installed
from te_ckpt_placement.integrations import megatron

from .support.imports import ROOT, imports, module_name


class Pair(NamedTuple):
    first: Any
    second: Any


def tree() -> dict[str, Any]:
    return {
        "untouched": {"a": torch.zeros(1), "b": [1, 2]},
        "ordered": collections.OrderedDict(x=torch.ones(2), y="keep"),
        "pair": Pair(torch.ones(3), "s"),
        "items": [torch.ones(4), (5, torch.ones(5))],
    }


def double_ones(value: Any, path: tuple[Any, ...]) -> Any:
    return value * 2 if isinstance(value, torch.Tensor) and bool((value == 1).all()) else value


def test_map_tree_changed_rebuilds_only_the_paths_to_replaced_leaves() -> None:
    original = tree()
    out = map_tree(original, double_ones)
    assert out is not original and out["untouched"] is original["untouched"]
    assert type(out["ordered"]) is collections.OrderedDict and out["ordered"]["y"] == "keep"
    assert torch.equal(out["ordered"]["x"], torch.full((2,), 2.0))
    assert type(out["pair"]) is Pair and out["pair"].second == "s"
    assert torch.equal(out["items"][1][1], torch.full((5,), 2.0))
    assert torch.equal(original["items"][0], torch.ones(4)), "the original was mutated"
    unchanged = {"a": [torch.zeros(1)], "b": (3,)}
    assert map_tree(unchanged, double_ones) is unchanged


def test_map_tree_always_copies_every_container_with_paths() -> None:
    seen: list[tuple[Any, ...]] = []

    def note(value: Any, path: tuple[Any, ...]) -> Any:
        seen.append(path)
        return value

    factory = collections.defaultdict(list, {"k": [1]})
    original = {"d": factory, "t": Pair(1, [2])}
    out = map_tree(original, note, rebuild="always")
    assert out is not original and out["d"] is not factory
    assert out["t"].second == [2] and out["t"].second is not original["t"].second
    assert isinstance(out["d"], collections.defaultdict) and out["d"].default_factory is list
    assert type(out["t"]) is Pair
    assert seen == [("d", "k", 0), ("t", 0), ("t", 1, 0)]


class Tagged(list[Any]):
    """A list subclass with an attribute of its own."""

    tag = "none"


def test_map_tree_copy_changed_keeps_what_a_container_holds_besides_its_items() -> None:
    factory = collections.defaultdict(list, {"k": torch.ones(1), "other": 1})
    tagged = Tagged([torch.ones(2), 3])
    tagged.tag = "kept"
    original = {"d": factory, "l": tagged, "same": {"z": torch.zeros(1)}}
    out = map_tree(original, double_ones, copy_changed=True)
    assert out["d"] is not factory and out["d"].default_factory is list
    assert torch.equal(out["d"]["k"], torch.full((1,), 2.0)) and out["d"]["other"] == 1
    assert type(out["l"]) is Tagged and out["l"].tag == "kept" and out["l"][1] == 3
    assert torch.equal(out["l"][0], torch.full((2,), 2.0))
    assert out["same"] is original["same"]
    assert torch.equal(factory["k"], torch.ones(1)) and torch.equal(tagged[0], torch.ones(2))
    # Without it, a rebuilt defaultdict is type(d)(): its factory is gone.
    assert map_tree(original, double_ones)["d"].default_factory is None


def test_iter_tree_yields_picks_in_order_and_stops_below_them() -> None:
    marker = types.SimpleNamespace(inner={"hidden": 1})
    found = list(
        iter_tree([{"a": 1, "b": marker}, (2, marker)], lambda v: v if v is marker else None)
    )
    assert found == [marker, marker]


def test_installed_is_each_old_lookup() -> None:
    assert installed("transformer_engine", "transformer-engine", module="transformer_engine") == (
        te_version()
    )
    assert (
        installed("megatron-core", module="megatron.core.package_info", default="not installed")
        == megatron.megatron_version()
    )
    assert installed("pytest") == pytest.__version__
    assert installed("no-such-distribution-here") == "unknown"


def test_installed_falls_back_to_an_imported_modules_version(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    module = types.ModuleType("te_ckpt_fake_checkout")
    module.__version__ = "9.9.9"  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "te_ckpt_fake_checkout", module)
    assert installed("no-such-distribution-here", module="te_ckpt_fake_checkout") == "9.9.9"
    assert installed("no-such-distribution-here", module="absent", default="none") == "none"


def package_sources() -> dict[str, ast.Module]:
    paths = sorted((ROOT / "te_ckpt_placement").rglob("*.py"))
    return {module_name(p): ast.parse(p.read_text(), filename=str(p)) for p in paths}


def test_only_versions_reads_distribution_metadata() -> None:
    """One version helper: every version lookup of the package goes through ``installed``."""
    readers = {
        module_name(path)
        for path in sorted((ROOT / "te_ckpt_placement").rglob("*.py"))
        for _, imported, _names in imports(path)
        if imported.startswith("importlib.metadata")
        or (imported == "importlib" and "metadata" in _names)
    }
    assert readers == {"te_ckpt_placement._versions"}


def test_only_tensors_defines_a_local_tensor_helper() -> None:
    """One local-tensor helper: no function of the package but ``_tensors.local`` returns a
    DTensor's ``_local_tensor``."""
    helpers = {
        f"{module}.{node.name}"
        for module, tree in package_sources().items()
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef)
        for ret in ast.walk(node)
        if isinstance(ret, ast.Return)
        and ret.value is not None
        and any(
            isinstance(a, ast.Attribute) and a.attr == "_local_tensor" for a in ast.walk(ret.value)
        )
    }
    assert helpers == {"te_ckpt_placement._tensors.local"}
