"""The load direction's layout and conversion rules, re-exported until the renames (P6).

The load's pipeline is :class:`._ring.Uploader`: the export's pinned ring run in reverse. Its
conversions are torch's own host kernels, chosen so that every byte equals what
``dst.copy_(src.float().bfloat16())`` (Transformer Engine's load of a BF16 state) leaves; the
rule lives in :mod:`._convert`, the layout helpers in :mod:`._tensors`. Nothing here knows
Transformer Engine.
"""

from __future__ import annotations

from ._convert import bf16_copy_is_vectorized, write_device
from ._tensors import may_overlap, memory_order, row_blocks, te_layout_like

__all__ = [
    "bf16_copy_is_vectorized",
    "may_overlap",
    "memory_order",
    "row_blocks",
    "te_layout_like",
    "write_device",
]
