"""The host worker pool made to split small tensors, so CPU tests take its path quickly."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from te_ckpt_placement import _convert, _workers


@contextlib.contextmanager
def small_pool(workers: int, *, task: int = 1000, block: int = 300) -> Iterator[int]:
    """``workers`` host workers (0: none) that split from ``task`` elements, in ``block``s."""
    saved = _workers.MIN_TASK_ELEMENTS, _convert.WORKER_BLOCK_ELEMENTS
    _workers.MIN_TASK_ELEMENTS, _convert.WORKER_BLOCK_ELEMENTS = task, block
    try:
        with _workers.sized(workers) as used:
            yield used
    finally:
        _workers.MIN_TASK_ELEMENTS, _convert.WORKER_BLOCK_ELEMENTS = saved
