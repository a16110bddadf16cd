"""The load direction's layout and conversion rules, re-exported until the renames (P6).

The load's pipeline is :class:`._ring.Uploader`: the export's pinned ring run in reverse. Its
conversions are torch's own host kernels, chosen so that every byte equals what
``dst.copy_(src.float().bfloat16())`` (Transformer Engine's load of a BF16 state) leaves; the
rule lives in :mod:`._convert`, the layout helpers in :mod:`._tensors`. Nothing here knows
Transformer Engine.
"""

from __future__ import annotations

from ._convert import bf16_copy_is_vectorized as bf16_copy_is_vectorized
from ._convert import write_device as write_device
from ._tensors import may_overlap as may_overlap
from ._tensors import memory_order as memory_order
from ._tensors import row_blocks as row_blocks
from ._tensors import te_layout_like as te_layout_like
