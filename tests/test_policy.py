"""Policy semantics: contextvars isolation, nesting, decorators, restore on error, validation."""

from __future__ import annotations

import asyncio
import functools
import inspect
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Callable, Generator, Iterator
from typing import Any

import pytest
import torch

from te_ckpt_placement import Placement, current_placement, export_placement


def device() -> str | None:
    p = current_placement()
    return None if p is None else p.device


def test_inactive_by_default() -> None:
    assert current_placement() is None


def test_context_manager_sets_and_restores() -> None:
    with export_placement("cpu") as placement:
        assert placement == Placement(device="cpu")
        assert current_placement() == placement
    assert current_placement() is None


def test_nesting_restores_outer_and_none_forces_default() -> None:
    with export_placement("cpu"):
        with export_placement(None):
            assert current_placement() == Placement(device=None)
            assert not current_placement().streams
            with export_placement("cpu", conversion="device"):
                assert current_placement().conversion == "device"
            assert device() is None
        assert current_placement() == Placement(device="cpu")
    assert current_placement() is None


def test_restores_when_block_raises() -> None:
    with pytest.raises(KeyError):
        with export_placement("cpu"):
            with export_placement(None):
                raise KeyError("boom")
    assert current_placement() is None

    with export_placement("cpu"):
        with pytest.raises(RuntimeError):
            with export_placement(None):
                raise RuntimeError
        assert device() == "cpu"


def test_same_object_reused_and_nested() -> None:
    policy = export_placement("cpu")
    with policy:
        with policy:
            assert device() == "cpu"
        assert device() == "cpu"
    assert current_placement() is None
    with policy:
        assert device() == "cpu"


def test_exit_out_of_order_is_refused() -> None:
    outer, inner = export_placement("cpu"), export_placement(None)
    outer.__enter__()
    inner.__enter__()
    with pytest.raises(RuntimeError, match="out of order"):
        outer.__exit__(None, None, None)
    # The refused exit still closed the outer block (a `with` never calls __exit__ twice); the
    # inner block is still open and keeps its policy.
    assert current_placement() == Placement(device=None)
    inner.__exit__(None, None, None)
    assert current_placement() is None
    with pytest.raises(RuntimeError, match="without a matching entry"):
        outer.__exit__(None, None, None)
    assert current_placement() is None


def test_decorator_on_def() -> None:
    @export_placement("cpu")
    def save(x: int) -> tuple[int, str | None]:
        return x, device()

    assert save(3) == (3, "cpu")
    assert save.__name__ == "save"
    assert current_placement() is None


def test_decorator_restores_on_exception() -> None:
    @export_placement("cpu")
    def fail() -> None:
        assert device() == "cpu"
        raise ValueError("x")

    with pytest.raises(ValueError):
        fail()
    assert current_placement() is None


def test_decorator_recursion_and_inner_override() -> None:
    @export_placement(None)
    def inner() -> str | None:
        return device()

    @export_placement("cpu")
    def outer(n: int) -> list[str | None]:
        seen = [device(), inner(), device()]
        return seen + (outer(n - 1) if n else [])

    assert outer(2) == ["cpu", None, "cpu"] * 3


def test_decorator_on_async_def_spans_awaits() -> None:
    @export_placement("cpu")
    async def save() -> list[str | None]:
        seen = [device()]
        await asyncio.sleep(0)
        seen.append(device())
        return seen

    async def main() -> tuple[list[str | None], str | None]:
        result = await save()
        return result, device()

    assert asyncio.run(main()) == (["cpu", "cpu"], None)


def test_decorator_on_async_def_restores_on_exception() -> None:
    @export_placement("cpu")
    async def fail() -> None:
        await asyncio.sleep(0)
        raise KeyError

    async def main() -> str | None:
        with pytest.raises(KeyError):
            await fail()
        return device()

    assert asyncio.run(main()) is None


def test_decorating_a_generator_is_refused() -> None:
    def gen():  # type: ignore[no-untyped-def]
        yield 1

    with pytest.raises(TypeError, match="generator"):
        export_placement("cpu")(gen)


def test_generator_advice_keeps_the_policy_off_yields() -> None:
    async def agen() -> AsyncIterator[int]:
        yield 1

    for gen in (lambda: (yield 1), agen):
        with pytest.raises(TypeError, match="generator") as info:
            export_placement("cpu")(gen)
        # Not "use `with export_placement(...)` inside the generator": held across a yield, that
        # policy is in effect in the caller between items.
        assert "end the block before the next `yield`" in str(info.value)
        assert "decorated with `@export_placement(...)`" in str(info.value)


def test_the_generator_advice_is_correct() -> None:
    """Both ways the advice gives keep the policy on the export and off the caller."""

    def scoped_in_body() -> Iterator[str | None]:
        for _ in range(2):
            with export_placement("cpu"):
                seen = device()
            yield seen

    @export_placement("cpu")
    def export() -> str | None:
        return device()

    def through_helper() -> Iterator[str | None]:
        for _ in range(2):
            yield export()

    for gen in (scoped_in_body, through_helper):
        assert [(seen, device()) for seen in gen()] == [("cpu", None)] * 2


class AsyncCallable:
    async def __call__(self, x: int) -> tuple[int, str | None]:
        await asyncio.sleep(0)
        return x, device()


async def _body(x: int) -> tuple[int, str | None]:
    await asyncio.sleep(0)
    return x, device()


def _plain_wrapper(func: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return func(*args, **kwargs)

    return wrapper


class _LazyAwaitable:
    """Not a coroutine: an object whose work runs when it is awaited."""

    def __await__(self) -> Generator[Any, None, tuple[int, str | None]]:
        return _body(5).__await__()


ASYNC_CASES: dict[str, Callable[[], Callable[..., Any]]] = {
    "async __call__": AsyncCallable,
    "functools.wraps wrapper": lambda: _plain_wrapper(_body),
    "torch.no_grad() over async def": lambda: torch.no_grad()(_body),
    "functools.partial": lambda: functools.partial(_body),
    "sync def returning an awaitable": lambda: lambda x: _LazyAwaitable(),
}


@pytest.mark.parametrize("case", list(ASYNC_CASES))
def test_decorator_scopes_the_awaited_body_of_any_async_callable(case: str) -> None:
    save = export_placement("cpu")(ASYNC_CASES[case]())

    async def main() -> list[tuple[int, str | None] | str | None]:
        # Also as concurrent tasks: each awaits its own body under the policy.
        results = await asyncio.gather(save(5), asyncio.ensure_future(save(5)))
        return [*results, device()]

    assert asyncio.run(main()) == [(5, "cpu"), (5, "cpu"), None]
    assert current_placement() is None


def test_task_returned_by_a_decorated_call_is_returned_as_is() -> None:
    async def main() -> None:
        created: list[asyncio.Task[tuple[int, str | None]]] = []

        @export_placement("cpu")
        def start() -> asyncio.Task[tuple[int, str | None]]:
            created.append(asyncio.ensure_future(_body(7)))  # copies the context: under "cpu"
            return created[-1]

        task = start()
        assert task is created[0]
        assert await task == (7, "cpu")
        assert device() is None

    asyncio.run(main())


def test_decorated_coroutine_function_stays_one() -> None:
    @export_placement("cpu")
    async def save() -> None: ...

    assert inspect.iscoroutinefunction(save)


class _Methods:
    @export_placement("cpu")
    @staticmethod
    def static(x: int) -> tuple[int, str | None]:
        return x, device()

    @export_placement("cpu")
    @classmethod
    def klass(cls, x: int) -> tuple[type, int, str | None]:
        return cls, x, device()

    @export_placement("cpu")
    @staticmethod
    async def static_async(x: int) -> tuple[int, str | None]:
        return await _body(x)


def test_decorator_over_staticmethod_and_classmethod() -> None:
    for owner in (_Methods, _Methods()):
        assert owner.static(1) == (1, "cpu")
        assert owner.klass(2) == (_Methods, 2, "cpu")
        assert asyncio.run(owner.static_async(3)) == (3, "cpu")
    assert current_placement() is None


def test_decorating_a_class_is_refused() -> None:
    class Checkpointer:
        def save(self) -> None: ...

    with pytest.raises(TypeError, match=r"class .*Checkpointer.*decorate the methods"):
        export_placement("cpu")(Checkpointer)


def test_decorating_a_non_callable_is_refused() -> None:
    with pytest.raises(TypeError, match="decorates functions"):
        export_placement("cpu")(property(lambda self: 1))  # type: ignore[type-var]


def test_generator_returned_through_a_wrapper_is_refused_and_closed() -> None:
    made: list[Generator[int, None, None]] = []

    def gen() -> Generator[int, None, None]:
        yield 1

    def wrapper() -> Generator[int, None, None]:
        made.append(gen())
        return made[-1]

    save = export_placement("cpu")(wrapper)
    with pytest.raises(TypeError, match=r"returned a generator.*before the next `yield`"):
        save()
    assert inspect.getgeneratorstate(made[0]) == inspect.GEN_CLOSED
    assert current_placement() is None


def test_async_generator_returned_through_a_wrapper_is_refused() -> None:
    async def agen() -> AsyncIterator[int]:
        yield 1

    for func in (_plain_wrapper(agen), torch.no_grad()(agen)):
        save = export_placement("cpu")(func)
        with pytest.raises(TypeError, match="returned an async generator"):
            save()
    assert current_placement() is None


def test_generator_behind_torch_no_grad_is_refused() -> None:
    @torch.no_grad()
    def gen() -> Iterator[int]:
        yield 1

    with pytest.raises(TypeError, match="generator"):
        export_placement("cpu")(gen)


def test_threads_see_only_their_own_policy() -> None:
    barrier = threading.Barrier(8)
    seen: dict[int, list[str | None]] = {}
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            mine = "cpu" if i % 2 else None
            out = [device()]
            with export_placement(mine):
                barrier.wait()  # all threads are inside their policy at once
                out.append(device())
                barrier.wait()
            out.append(device())
            seen[i] = out
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    with export_placement("cpu"):  # the main thread's policy does not leak into workers
        threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert device() == "cpu"
    assert not errors
    for i in range(8):
        assert seen[i] == [None, "cpu" if i % 2 else None, None]


def test_shared_decorated_function_across_threads() -> None:
    barrier = threading.Barrier(4)

    @export_placement("cpu")
    def save() -> str | None:
        barrier.wait()
        return device()

    results: list[str | None] = []
    threads = [threading.Thread(target=lambda: results.append(save())) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == ["cpu"] * 4


def test_asyncio_tasks_are_isolated() -> None:
    async def task(i: int) -> list[str | None]:
        mine = "cpu" if i % 2 else None
        with export_placement(mine):
            await asyncio.sleep(0.001 * (i % 3))
            first = device()
            await asyncio.sleep(0)
            second = device()
        return [first, second, device()]

    async def main() -> list[list[str | None]]:
        with export_placement("cpu"):
            # Tasks copy the context at creation: each starts under "cpu", then sets its own.
            return await asyncio.gather(*(task(i) for i in range(100)))

    results = asyncio.run(main())
    for i, r in enumerate(results):
        mine = "cpu" if i % 2 else None
        assert r == [mine, mine, "cpu"]


@pytest.mark.parametrize("bad", ["cuda:7", "tpu", "", "CPU", "cuda", torch.device("cuda", 0), 0])
def test_invalid_device_names_valid_values(bad: object) -> None:
    with pytest.raises(ValueError, match=r"valid values are 'cpu'.*None"):
        export_placement(bad)  # type: ignore[arg-type]
    assert current_placement() is None


@pytest.mark.parametrize("bad", ["gpu", None, 1, ""])
def test_invalid_conversion_names_valid_values(bad: object) -> None:
    with pytest.raises(ValueError, match=r"valid values are 'host'.*'device'"):
        export_placement("cpu", conversion=bad)  # type: ignore[arg-type]


def test_bare_decorator_says_to_add_parentheses() -> None:
    with pytest.raises(TypeError, match=r'@export_placement\("cpu"\)'):

        @export_placement  # type: ignore[arg-type]
        def save() -> None: ...

    with pytest.raises(TypeError, match=r'@export_placement\("cpu"\)'):

        class Owner:
            @export_placement  # type: ignore[arg-type]
            @staticmethod
            def save() -> None: ...


@pytest.mark.parametrize(
    "options",
    [
        {"conversion": "nonsense"},
        {"conversion": "host"},
        {"reuse_buffers": True},
        {"rollback": False},
    ],
)
def test_options_next_to_a_placement_are_refused(options: dict[str, object]) -> None:
    with pytest.raises(ValueError, match=r"either one Placement.*or a device and options"):
        export_placement(Placement(device="cpu"), **options)  # type: ignore[arg-type]


def test_left_out_options_take_placements_defaults() -> None:
    assert export_placement("cpu").placement == Placement(device="cpu")
    assert export_placement(None, conversion="device").placement == Placement(
        device=None, conversion="device"
    )
    given = Placement(device="cpu", conversion="device", reuse_buffers=True, rollback=False)
    assert export_placement(given).placement is given


def test_options_are_keyword_only() -> None:
    with pytest.raises(TypeError):
        export_placement("cpu", "device")  # type: ignore[misc]


def test_placement_is_frozen_and_normalizes_device() -> None:
    p = Placement(device=torch.device("cpu"))  # type: ignore[arg-type]
    assert p.device == "cpu"
    with pytest.raises(AttributeError):
        p.device = None  # type: ignore[misc]


def test_import_does_not_import_transformer_engine() -> None:
    code = (
        "import sys, te_ckpt_placement as t\n"
        "with t.export_placement('cpu'): pass\n"
        "assert not [m for m in sys.modules if m.startswith('transformer_engine')], 'imported TE'\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_star_import_works_without_transformer_engine() -> None:
    code = (
        "import sys\n"
        "from te_ckpt_placement import *  # noqa: F403\n"
        "assert export_placement and current_placement and Placement  # noqa: F405\n"
        "assert not [m for m in sys.modules if m.startswith('transformer_engine')]\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
