"""The tensor memory that code allocates, op by op: a CPU measure of temporaries.

:class:`Allocations` is a ``TorchDispatchMode`` that notes every storage an aten op makes (an
output that shares no input's storage) and, after each op, which of them are gone. From those
lifetimes it tells the most bytes alive at once among the storages that did not outlive the block
(:attr:`Allocations.peak_temporary`): the temporaries, whatever the states kept at the end
occupy. Allocations inside a kernel (a conversion's scratch) are not seen; what CUDA's allocator
would round up is not counted.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["Allocations"]


class Allocations(TorchDispatchMode):
    """Storages made inside the block: their sizes and the op steps they were alive."""

    def __init__(self) -> None:
        super().__init__()
        self.step = 0
        # [weak ref, bytes, step made, step found gone (None: alive)]
        self._made: list[list[Any]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.step += 1
        self._sweep()
        inputs = {
            t.untyped_storage().data_ptr()
            for t in pytree.tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor)
        }
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                if storage.data_ptr() not in inputs and storage.nbytes() > 0:
                    inputs.add(storage.data_ptr())  # an op's outputs may share one storage
                    self._made.append([StorageWeakRef(storage), storage.nbytes(), self.step, None])
        return out

    def _sweep(self) -> None:
        for entry in self._made:
            if entry[3] is None and entry[0].expired():
                entry[3] = self.step

    @property
    def kept_bytes(self) -> int:
        """Bytes of the storages made in the block that are still alive."""
        self._sweep()
        return sum(n for _, n, _, gone in self._made if gone is None)

    @property
    def peak_temporary(self) -> int:
        """The most bytes alive at once, after some op, of the storages that are gone now."""
        self._sweep()
        gone = [(made, end, n) for _, n, made, end in self._made if end is not None]
        peak = 0
        for step in {made for made, _, _ in gone}:  # the total only grows where one is made
            peak = max(peak, sum(n for made, end, n in gone if made <= step < end))
        return peak
