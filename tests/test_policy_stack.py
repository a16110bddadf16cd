"""The policy stack under interrupts, raising hooks and out-of-order exits (generators).

Every test runs in a copied context, so that a frame left behind fails this test and no other.
"""

from __future__ import annotations

import contextvars
import dis
import gc
import itertools
import sys
import types
from collections.abc import Callable, Generator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from te_ckpt_placement import ContractError, Placement, current_placement, export_placement
from te_ckpt_placement import _policy as policy

CPU, DEFAULT = Placement(device="cpu"), Placement(device=None)
POLICY_FILE = export_placement.__enter__.__code__.co_filename
EXIT_CODE = export_placement.__exit__.__code__
FRAME_NEW = policy._Frame.__new__.__code__
CALLS = {op for name, op in dis.opmap.items() if name.startswith("CALL")}
CHECKS = {dis.opmap[n] for n in ("RESUME", "JUMP_BACKWARD", "JUMP_ABSOLUTE") if n in dis.opmap}


def device() -> str | None:
    p = current_placement()
    return None if p is None else p.device


def in_fresh_context(func: Callable[[], Any]) -> Any:
    return contextvars.copy_context().run(func)


class Interrupt:
    """A trace function that raises KeyboardInterrupt at the n-th interrupt point of the policy.

    CPython runs signal handlers only on entering a function (RESUME), on a backward jump and
    right after a call returns. The points are all of those in the policy's code (_policy.py and
    the frame tuple's constructor), but one: the entry of ``__exit__``, before any of its code
    runs, which no Python code can guard. A trace function that raises is unset, so each run
    injects exactly one interrupt.
    """

    def __init__(self, n: int) -> None:
        self.n, self.count = n, 0
        self.fired: tuple[str, int] | None = None
        self.after_call: set[types.FrameType] = set()
        self.opcodes = 0  # opcode events seen: none means this Python did not deliver them

    def __call__(self, frame: types.FrameType, event: str, arg: object) -> Any:
        if frame.f_code.co_filename != POLICY_FILE and frame.f_code is not FRAME_NEW:
            return None
        frame.f_trace_opcodes = True
        # A function's entry; not a generator's resumption (RESUME is a point in 3.11+, and
        # 3.10 delivers no signal there).
        if frame.f_code is not EXIT_CODE and frame.f_lasti <= 0:
            self._point(frame)
        return self._local

    def _local(self, frame: types.FrameType, event: str, arg: object) -> Any:
        frame.f_trace_opcodes = True  # Python 3.13 needs it here
        if event == "opcode":
            self.opcodes += 1
            op = frame.f_code.co_code[frame.f_lasti]
            after_call = frame in self.after_call
            self.after_call.discard(frame)
            if after_call or (op in CHECKS and frame.f_code is not EXIT_CODE):
                self._point(frame)
            if op in CALLS:
                self.after_call.add(frame)
        return self._local

    def _point(self, frame: types.FrameType) -> None:
        if self.count == self.n:
            self.fired = (frame.f_code.co_name, frame.f_lasti)
            raise KeyboardInterrupt
        self.count += 1


def interrupted(statement: Callable[[], Any], interrupt: Interrupt) -> bool:
    """Runs ``statement`` under ``interrupt``; True if the interrupt came out of it."""
    previous, me = sys.gettrace(), sys._getframe()
    me.f_trace_opcodes = True  # Python 3.12 sends opcode events only if set before settrace
    sys.settrace(interrupt)
    try:
        statement()
    except KeyboardInterrupt:
        assert interrupt.fired is not None, "a KeyboardInterrupt that was not injected"
        return True
    finally:
        sys.settrace(previous)
        me.f_trace_opcodes = False
    return False


def each_interrupt(scenario: Callable[[Interrupt], None]) -> set[str]:
    """Runs ``scenario`` once per interrupt point, then once without; the functions hit."""
    hit: set[str] = set()
    for n in itertools.count():
        interrupt = Interrupt(n)
        in_fresh_context(lambda: scenario(interrupt))  # noqa: B023 - called right here
        if interrupt.fired is None:
            assert n > 10 and interrupt.opcodes, "the interrupt points were not traced"
            return hit
        hit.add(interrupt.fired[0])
    raise AssertionError("unreachable")


def test_interrupt_anywhere_in_enter_or_exit_leaves_no_policy() -> None:
    def scenario(interrupt: Interrupt) -> None:
        policy_ = export_placement("cpu")
        seen: list[Placement | None] = []

        def block() -> None:
            with policy_:
                seen.append(current_placement())

        interrupted(block, interrupt)
        assert current_placement() is None
        assert seen in ([], [CPU])

    hit = each_interrupt(scenario)
    assert {"__enter__", "__exit__", "_close"} <= hit


def test_interrupt_in_an_inner_block_keeps_the_outer_one() -> None:
    def scenario(interrupt: Interrupt) -> None:
        outer, inner = export_placement("cpu"), export_placement(None)

        def block() -> None:
            with inner:
                assert current_placement() == DEFAULT

        with outer:
            interrupted(block, interrupt)
            assert current_placement() == CPU
        assert current_placement() is None

    each_interrupt(scenario)


def test_interrupt_in_a_reentered_object_closes_only_its_own_block() -> None:
    def scenario(interrupt: Interrupt) -> None:
        shared = export_placement("cpu")

        def block() -> None:
            with shared:
                pass

        with shared:
            interrupted(block, interrupt)
            assert current_placement() == CPU
        assert current_placement() is None  # a frame of the inner entry would be left here

    each_interrupt(scenario)


def test_interrupt_while_exiting_on_an_exception() -> None:
    def scenario(interrupt: Interrupt) -> None:
        def block() -> None:
            with pytest.raises(ValueError), export_placement("cpu"):
                raise ValueError

        interrupted(block, interrupt)
        assert current_placement() is None

    each_interrupt(scenario)


@export_placement("cpu")
def decorated() -> Placement | None:
    return current_placement()


@types.coroutine
def suspend() -> Generator[None, None, None]:
    yield


@export_placement("cpu")
async def decorated_async() -> Placement | None:
    await suspend()
    return current_placement()


def returns_a_coroutine() -> Any:
    return decorated_async.__wrapped__()  # type: ignore[attr-defined]


# An interrupt between creating a coroutine and awaiting it drops it, never awaited.
@pytest.mark.filterwarnings("ignore:coroutine .* was never awaited:RuntimeWarning")
@pytest.mark.parametrize(
    "func", [decorated, decorated_async, export_placement()(returns_a_coroutine)]
)
def test_interrupt_in_a_decorated_call(func: Callable[[], Any]) -> None:
    def scenario(interrupt: Interrupt) -> None:
        def call() -> None:
            result = func()
            if not isinstance(result, types.CoroutineType):
                assert result == CPU
                return
            try:
                while True:
                    result.send(None)
            except StopIteration as stop:
                assert stop.value == CPU
            finally:
                result.close()

        interrupted(call, interrupt)
        assert current_placement() is None

    each_interrupt(scenario)
    gc.collect()  # the dropped coroutines warn here, not in a later test


class HookError(Exception):
    pass


@pytest.mark.parametrize("error", [ContractError("bad TE"), HookError(), KeyboardInterrupt()])
def test_raising_on_enter_hook_leaves_nothing_pushed(
    error: BaseException, monkeypatch: pytest.MonkeyPatch
) -> None:
    def hook() -> None:
        raise error

    monkeypatch.setattr(policy, "_ON_ENTER", [hook])

    def scenario() -> None:
        with pytest.raises(type(error)), export_placement("cpu"):
            pytest.fail("the block ran although a hook raised")
        assert current_placement() is None
        with export_placement(None):  # not streaming: no hooks
            with pytest.raises(type(error)), export_placement("cpu"):
                pytest.fail("the block ran although a hook raised")
            assert current_placement() == DEFAULT
        assert current_placement() is None

    in_fresh_context(scenario)


def leaky(placement: str | None) -> Generator[str | None, None, None]:
    """The pattern the advice forbids: a policy held across yields."""
    with export_placement(placement):
        yield device()
        yield device()


def test_generator_closed_inside_another_policy_leaves_no_policy() -> None:
    def scenario() -> None:
        gen = leaky("cpu")
        next(gen)
        assert device() == "cpu"  # the leak into the caller that the advice is about
        with pytest.raises(RuntimeError, match="out of order") as info:
            with export_placement(None):
                gen.close()
        assert "end the block before the next `yield`" in str(info.value)
        assert "could not be seen" not in str(info.value)  # raised once, not again by the block
        assert current_placement() is None

    in_fresh_context(scenario)


def test_out_of_order_error_caught_in_the_block_is_raised_again_by_it() -> None:
    def scenario() -> None:
        gen = leaky("cpu")
        next(gen)
        with pytest.raises(RuntimeError, match="could not be seen"):
            with export_placement(None):
                with pytest.raises(RuntimeError, match="out of order"):
                    gen.close()
        assert current_placement() is None

    in_fresh_context(scenario)


def test_generator_collected_inside_another_policy_raises_where_it_is_seen(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    unraisable: list[Any] = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)

    def scenario() -> None:
        gen = leaky("cpu")
        next(gen)
        with pytest.raises(RuntimeError, match="could not be seen") as info:
            with export_placement(None):
                del gen  # the garbage collector closes it: its exit's error is unraisable
                assert current_placement() == DEFAULT
        assert "out of order" in str(info.value.__cause__)
        assert current_placement() is None

    in_fresh_context(scenario)
    assert [type(u.exc_value) for u in unraisable] == [RuntimeError]


def test_block_exited_while_a_generator_holds_a_policy() -> None:
    def scenario() -> None:
        with pytest.raises(RuntimeError, match="out of order"):
            with export_placement("cpu"):
                gen = leaky(None)
                next(gen)
        assert current_placement() == DEFAULT  # the generator's block is still open
        assert next(gen) is None
        gen.close()  # in order now
        assert current_placement() is None

    in_fresh_context(scenario)


def test_generator_exhausted_inside_another_policy() -> None:
    def scenario() -> None:
        gen = leaky("cpu")
        next(gen)
        with export_placement(None):
            with pytest.raises(RuntimeError, match="out of order"):
                list(gen)  # its block exits in the caller's flow: raised right there
            assert current_placement() == DEFAULT
        assert current_placement() is None

    in_fresh_context(scenario)


OWNERS = [
    export_placement("cpu"),
    export_placement(None),
    export_placement("cpu", conversion="device"),
]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, len(OWNERS) - 1)), max_size=30))
def test_stack_is_the_open_blocks_in_entry_order(ops: list[tuple[bool, int]]) -> None:
    """Any order of enters and exits: the policy is that of the innermost block still open."""

    def run() -> None:
        open_blocks: list[int] = []  # the model
        for enter, i in ops:
            if enter:
                OWNERS[i].__enter__()
                open_blocks.append(i)
            else:
                mine = [j for j, owner in enumerate(open_blocks) if owner == i]
                if not mine:
                    with pytest.raises(RuntimeError, match="without a matching entry"):
                        OWNERS[i].__exit__(None, None, None)
                elif mine[-1] != len(open_blocks) - 1:
                    with pytest.raises(RuntimeError, match="out of order"):
                        OWNERS[i].__exit__(None, None, None)
                    del open_blocks[mine[-1]]
                else:
                    OWNERS[i].__exit__(None, None, None)
                    open_blocks.pop()
            expected = OWNERS[open_blocks[-1]].placement if open_blocks else None
            assert current_placement() == expected
        for i in reversed(open_blocks):
            OWNERS[i].__exit__(None, None, None)
        assert current_placement() is None

    in_fresh_context(run)
