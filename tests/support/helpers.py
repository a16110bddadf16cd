"""Comparisons shared by the CPU and GPU tests: bit-exact exports and storage ownership."""

from __future__ import annotations

import io
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.distributed.tensor import DTensor


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a tensor, on the CPU, so NaNs and signed zeros compare exactly."""
    t = t.detach().contiguous().cpu()
    return t.reshape(-1).view(torch.uint8)


def assert_bit_equal(a: torch.Tensor, b: torch.Tensor, where: str = "") -> None:
    assert type(a) is type(b), f"{where}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, DTensor):
        assert a.device_mesh == b.device_mesh, f"{where}: mesh differs"
        assert tuple(a.placements) == tuple(b.placements), f"{where}: placements differ"
        assert a.shape == b.shape and a.stride() == b.stride(), f"{where}: global shape/stride"
        a, b = a._local_tensor, b._local_tensor
    assert a.dtype == b.dtype, f"{where}: dtype {a.dtype} != {b.dtype}"
    assert a.shape == b.shape, f"{where}: shape {a.shape} != {b.shape}"
    assert torch.equal(bits(a), bits(b)), f"{where}: values differ"


def assert_same_export(ours: Any, ref: Any, where: str = "") -> None:
    """Same structure, keys, types, dtypes and bits; tensors may sit on different devices."""
    if isinstance(ref, torch.Tensor):
        assert isinstance(ours, torch.Tensor), f"{where}: expected a tensor"
        assert_bit_equal(ours, ref, where)
    elif isinstance(ref, dict):
        assert isinstance(ours, dict) and list(ours) == list(ref), f"{where}: keys differ"
        for key in ref:
            assert_same_export(ours[key], ref[key], f"{where}.{key}")
    elif isinstance(ref, (list, tuple)):
        assert type(ours) is type(ref) and len(ours) == len(ref), f"{where}: sequence differs"
        for i, (x, y) in enumerate(zip(ours, ref, strict=True)):
            assert_same_export(x, y, f"{where}[{i}]")
    else:
        assert ours == ref, f"{where}: {ours!r} != {ref!r}"


def local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def tensors(tree: Any) -> Iterator[torch.Tensor]:
    """Every tensor of a nest of dicts, lists and tuples, in order."""
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, dict):
        for value in tree.values():
            yield from tensors(value)
    elif isinstance(tree, (list, tuple)):
        for value in tree:
            yield from tensors(value)


@torch.no_grad()
def blank(tree: Any) -> None:
    """Overwrites every tensor of a load template, so a load that skips one cannot pass."""
    for t in tensors(tree):
        loc = local(t)
        loc.fill_(float("nan") if loc.is_floating_point() else -7)


def exported_tensors(state_dict: dict[str, Any]) -> list[torch.Tensor]:
    return [t for states in state_dict["state"].values() for t in states.values()]


def assert_owns_storage(t: torch.Tensor) -> None:
    """DCP's writer clones a tensor whose storage is larger than itself; ours never are."""
    t = local(t)
    assert t.storage_offset() == 0
    assert t.untyped_storage().nbytes() == t.numel() * t.element_size()


def live_storages(optimizer: torch.optim.Optimizer) -> set[int]:
    ptrs = set()
    for states in optimizer.state.values():
        for value in states.values():
            v = local(value)
            data = getattr(v, "_data", v)
            if data.numel():  # empty tensors all share the null pointer
                ptrs.add(data.untyped_storage().data_ptr())
    return ptrs


def aliases_live(t: torch.Tensor, live: set[int]) -> bool:
    t = local(t)
    return t.numel() > 0 and t.untyped_storage().data_ptr() in live


def snapshot(optimizer: torch.optim.Optimizer) -> dict[Any, dict[str, torch.Tensor]]:
    """A bit-level copy of every live state (FP8 as its bytes and scale_inv)."""
    out: dict[Any, dict[str, torch.Tensor]] = {}
    for p, states in optimizer.state.items():
        out[p] = {}
        for name, value in states.items():
            v = local(value) if isinstance(value, torch.Tensor) else value
            if hasattr(v, "_data"):
                out[p][name] = torch.cat([bits(v._data), bits(v._scale_inv)])
            elif isinstance(v, torch.Tensor):
                out[p][name] = bits(v).clone()
            else:  # torch keeps entries of unknown keys as they are
                out[p][name] = torch.tensor([hash(repr(v))])
    return out


def assert_snapshot_equal(a: dict[Any, Any], b: dict[Any, Any]) -> None:
    assert a.keys() == b.keys()
    for p in a:
        assert a[p].keys() == b[p].keys()
        for name in a[p]:
            assert torch.equal(a[p][name], b[p][name]), f"live state {name} changed"


def through_torch_save(obj: Any) -> Any:
    """``obj`` after a ``torch.save``/``torch.load`` round trip (weights only)."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def peak_extra(fn: Callable[[], Any]) -> tuple[Any, int]:
    """Runs ``fn`` and returns its result and the CUDA allocation peak above the start."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    return out, torch.cuda.max_memory_allocated() - base
