"""A cheap fingerprint of a loaded checkpoint, for ranks that must have read the same one.

Ranks that each read a checkpoint from one path read the same file only where the path is on a
file system they share: another node's disk can hold another save at that path. torch's
full-state load broadcasts rank 0's values, so its ranks cannot mix checkpoints; ranks that
slice their own copies must compare what they read. A checksum of every byte would read the
whole checkpoint on every rank, which reads only its own shard of each state. The fingerprint
hashes the checkpoint's structure (keys, container kinds), every value that is not a tensor
(steps, hyperparameters), every tensor's dtype and shape, and :data:`SAMPLES` evenly spaced
elements of each tensor, the first and the last among them, so it reads at most that many pages
of a tensor. Two saves of one run differ in their steps, saves of two runs in nearly every
element; two files that differ only in elements between the samples are not told apart.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

#: Elements hashed per tensor, evenly spaced from its first to its last.
SAMPLES = 16


def fingerprint(checkpoint: Any) -> str:
    """``"step 5, content <16 hex digits>"``: the checkpoint's steps (every value under a
    ``"step"`` key) and its digest. Equal for the same checkpoint read anywhere."""
    digest = hashlib.blake2b(digest_size=8)
    steps: list[Any] = []
    _hash(checkpoint, digest, steps, key=None)
    # torch keeps a step as a float tensor, TE as an int: 7.0 and 7 are one step.
    distinct = sorted({int(s) if float(s).is_integer() else s for s in steps})
    if not distinct:
        label = "no step"
    elif len(distinct) == 1:
        label = f"step {distinct[0]}"
    else:
        more = ", ..." if len(distinct) > 4 else ""
        label = "steps " + ", ".join(map(str, distinct[:4])) + more
    return f"{label}, content {digest.hexdigest()}"


def _put(digest: Any, text: str) -> None:
    data = text.encode()
    digest.update(len(data).to_bytes(8, "little"))
    digest.update(data)


def _hash(value: Any, digest: Any, steps: list[Any], key: Any) -> None:
    if isinstance(value, torch.Tensor):
        _put(digest, f"tensor {value.dtype} {tuple(value.shape)} {value.layout}")
        digest.update(_sample(value))
        if key == "step" and value.numel() == 1 and _readable(value) and not value.is_complex():
            steps.append(value.item())
    elif isinstance(value, dict):
        _put(digest, f"dict {len(value)}")
        for k, v in value.items():
            _put(digest, repr(k))
            _hash(v, digest, steps, key=k)
    elif isinstance(value, (list, tuple)):
        _put(digest, f"{type(value).__name__} {len(value)}")
        for v in value:
            _hash(v, digest, steps, key=None)
    else:
        _put(digest, repr(value))
        if key == "step" and isinstance(value, (int, float)):
            steps.append(value)


def _readable(t: torch.Tensor) -> bool:
    """A dense tensor with values on this host (not meta, sparse, nested or quantized)."""
    return (
        t.layout == torch.strided
        and not t.is_meta
        and not t.is_nested
        and not t.is_quantized
        and t.device.type == "cpu"
    )


def _sample(t: torch.Tensor) -> bytes:
    """The bytes of up to :data:`SAMPLES` evenly spaced elements of ``t`` (none for a tensor
    without readable values: its kind is hashed alone)."""
    n = t.numel()
    if n == 0 or not _readable(t):
        return b""
    positions = torch.linspace(0, n - 1, min(n, SAMPLES), dtype=torch.float64).round().long()
    picked = t.reshape(1) if t.dim() == 0 else t[torch.unravel_index(positions, t.shape)]
    return bytes(picked.contiguous().view(torch.uint8).tolist())
