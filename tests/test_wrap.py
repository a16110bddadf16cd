"""te_ckpt_placement/_wrap.py: the one add/remove pair every method wrapper of the package uses."""

from __future__ import annotations

import pickle
from typing import Any

import pytest

from te_ckpt_placement import _wrap


class Base:
    def run(self, x: int) -> str:
        return f"base {x}"


class Child(Base):
    pass


def tagged(tag: str, obj: Any, original: Any, *args: Any) -> str:
    return f"{tag}({original(*args)})"


def outer(obj: Any, original: Any, *args: Any) -> str:
    return tagged("outer", obj, original, *args)


def inner(obj: Any, original: Any, *args: Any) -> str:
    return tagged("inner", obj, original, *args)


def test_instance_wrappers_stack_by_owner_and_restore_exactly() -> None:
    obj, other = Base(), Base()
    before = dict(vars(obj))
    first = _wrap.add_wrapper(obj, "run", inner, owner="a")
    assert _wrap.add_wrapper(obj, "run", outer, owner="a") is first  # idempotent per owner
    _wrap.add_wrapper(obj, "run", outer, owner="b")
    assert obj.run(1) == "outer(inner(base 1))" and other.run(1) == "base 1"
    assert list(_wrap.wrappers(obj)) == ["run"] and set(_wrap.wrappers(obj, "a")) == {"run"}
    assert _wrap.original(obj, "run") is first  # what the outermost wrapper replaced
    assert _wrap.remove_wrapper(obj, owner="b") and obj.run(2) == "inner(base 2)"
    assert _wrap.remove_wrapper(obj, "run", owner="a") and not _wrap.remove_wrapper(obj, owner="a")
    assert vars(obj) == before and obj.run(3) == "base 3"


def test_a_replaced_wrapper_is_left_with_a_warning() -> None:
    obj = Base()
    _wrap.add_wrapper(obj, "run", inner)

    def mine(x: int) -> str:
        return "mine"

    obj.run = mine  # type: ignore[method-assign]
    with pytest.warns(RuntimeWarning, match=r"Base\.run was replaced after somebody; leaving"):
        assert _wrap.remove_wrapper(obj, replaced="somebody")
    assert obj.run is mine and _wrap.wrappers(obj) == {}


def test_class_wrappers_look_up_the_mro_after_the_class_at_call_time() -> None:
    class Mixin:
        pass

    class Placed(Mixin, Child):
        pass

    _wrap.add_wrapper(Mixin, "run", inner, doc="documented")
    assert Placed().run(1) == "inner(base 1)"
    assert Placed.run.__qualname__.endswith("Mixin.run") and Placed.run.__doc__ == "documented"
    assert _wrap.current(Mixin, "run") is not None and _wrap.original(Mixin, "run") is None
    assert _wrap.remove_wrapper(Mixin) and "run" not in vars(Mixin)
    assert _wrap.RECORD not in vars(Mixin)


def test_a_class_wrapper_keeps_the_class_own_method_as_original() -> None:
    class Own(Base):
        def run(self, x: int) -> str:
            return f"own {x}"

    own = vars(Own)["run"]
    _wrap.add_wrapper(Own, "run", outer)
    assert Own().run(1) == "outer(own 1)" and _wrap.original(Own, "run") is own
    with _wrap.wrapping(Own, "run", inner, owner="block"):
        assert Own().run(2) == "inner(outer(own 2))"
    assert Own().run(3) == "outer(own 3)"
    _wrap.remove_wrapper(Own)
    assert vars(Own)["run"] is own


def test_an_instance_wrapper_pickles_with_its_instance() -> None:
    obj = Child()
    _wrap.add_wrapper(obj, "run", outer)
    copy = pickle.loads(pickle.dumps(obj))
    assert copy.run(1) == "outer(base 1)" and vars(copy)["run"].target is copy
    assert _wrap.remove_wrapper(copy) and "run" not in vars(copy)
    assert obj.run(2) == "outer(base 2)"
