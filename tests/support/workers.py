"""The host workers' team made to take small tensors, so CPU tests take its path quickly."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from te_ckpt_placement import _convert, _workers


@contextlib.contextmanager
def small_team(workers: int, *, elements: int = 1000, block: int = 300) -> Iterator[int]:
    """A team of ``workers`` threads (0: none) that takes conversions from ``elements``
    elements, converting in ``block``-element blocks."""
    saved = _workers.MIN_ELEMENTS, _convert.BLOCK_ELEMENTS
    _workers.MIN_ELEMENTS, _convert.BLOCK_ELEMENTS = elements, block
    try:
        with _workers.sized(workers) as used:
            yield used
    finally:
        _workers.MIN_ELEMENTS, _convert.BLOCK_ELEMENTS = saved
