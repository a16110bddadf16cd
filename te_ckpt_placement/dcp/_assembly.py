"""The host assembly buffers of ``StreamingLoadPlanner``: states written whole, not item by item.

Two kinds of state cannot take a checkpoint item on its own:

- FP16 and FP8 states, which TE scales by the absmax of the whole local state (``_apply_scale``,
  TE 2.20.2 fused_adam.py L268-308);
- BF16, FP32 and int16 (master remainder) states whose saved pieces are strided regions of the
  local state (a reshard along a later dimension: ``Shard(1)`` parameters loaded on another
  world size). A copy into such a region of a GPU state would stage on the GPU, and convert an
  FP32 piece to BF16 with the kernel of the piece's layout instead of the whole state's.

Each is assembled in one host buffer of its local state, in the dtype that TE's export gives it and
``set_scaled_state`` takes (int16 for master remainders, FP32 for everything else: L371-380), which
is what the template path's template holds too, and written whole through ``te_load.write_prepared``
once its last item has arrived (checked by ``te_load.check_states`` first). :class:`Assembly` checks
every such write before the first read (a refusal then leaves every state as it was), sizes the
default budget, counts the bytes held and warns once over the budget.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from .. import _te_load as te_load

if TYPE_CHECKING:
    from .._te_contract import Contract
    from ._load_targets import _Target


def buffer_dtype(target: _Target) -> torch.dtype:
    """The dtype of a state's assembly buffer: what TE's export holds and its load takes."""
    return torch.int16 if target.remainder else torch.float32


def _nbytes(target: _Target) -> int:
    return target.numel * buffer_dtype(target).itemsize


def _kind(target: _Target) -> str:
    return "FP16/FP8" if target.whole else "strided"


class Assembly:
    """The assembly buffers of one load: the budget, the bytes held, and their peak."""

    def __init__(self, max_bytes: int | None, warning: type[Warning]) -> None:
        self.max_bytes = max_bytes
        self.warning = warning
        self.budget = 0 if max_bytes is None else max_bytes
        self.open_bytes = 0
        self.peak_bytes = 0
        self._open = {"FP16/FP8": 0, "strided": 0}  # buffers held, by kind
        self._warned = False

    def plan(self, targets: Iterable[_Target]) -> None:
        """Checks every write of an assembled state and sets the default budget.

        Raises ``ValueError`` (no state was written) where ``te_load.check_states`` (the check
        ``te_load.load_state`` makes) would refuse a buffer; a state with no local elements has no
        items and is never written.
        """
        assembled = [t for t in targets if t.live is None and t.numel > 0]
        writes: dict[int, tuple[Contract, list[tuple[torch.Tensor, str, torch.Tensor]]]] = {}
        for target in assembled:
            # The write's own checks, on a stand-in of the buffer (its dtype and shape, no data).
            probe = torch.empty((), dtype=buffer_dtype(target)).expand(target.local_shape)
            entry = writes.setdefault(id(target.contract), (target.contract, []))
            entry[1].append((target.param, target.name, probe))
        for contract, states in writes.values():
            try:
                te_load.check_states(contract.optimizer, states, contract=contract)
            except ValueError as exc:
                raise ValueError(
                    "cannot load the optimizer checkpoint: a state assembled on the host would "
                    f"be refused when written ({exc}). No state was written."
                ) from exc
        if self.max_bytes is None:
            self.budget = max((_nbytes(t) for t in assembled), default=0)

    def allocate(self, target: _Target) -> torch.Tensor:
        """The host buffer of ``target``'s local state; warns once over the budget."""
        nbytes = _nbytes(target)
        kind = _kind(target)
        if self.open_bytes + nbytes > self.budget and not self._warned:
            self._warned = True
            held = dict(self._open, **{kind: self._open[kind] + 1})
            states = sum(held.values())
            described = ", ".join(
                f"{count} {what}"
                for what, count in (
                    ("FP16/FP8", held["FP16/FP8"]),
                    ("BF16/FP32/int16 saved in strided pieces", held["strided"]),
                )
                if count
            )
            warnings.warn(
                f"StreamingLoadPlanner holds {self.open_bytes + nbytes} bytes of host assembly "
                f"buffers for {states} state{'s' if states > 1 else ''} ({described}), over "
                f"max_assembly_bytes={self.budget}: the saved pieces of these states arrive "
                "interleaved (a load on another world size reads file by file). The load "
                "completes; the buffers are at most the size of the assembled states (FP32, "
                "int16 for master remainders)",
                self.warning,
                stacklevel=4,
            )
        buffer = torch.empty(target.local_shape, dtype=buffer_dtype(target))
        self.open_bytes += nbytes
        self._open[kind] += 1
        self.peak_bytes = max(self.peak_bytes, self.open_bytes)
        return buffer

    def release(self, target: _Target) -> None:
        """Counts ``target``'s buffer as freed (the caller drops it)."""
        self.open_bytes -= _nbytes(target)
        self._open[_kind(target)] -= 1
