"""Memory mx reads from or writes into without owning it: torch tensors, numpy arrays, objects
with ``__dlpack__`` and buffers (``memoryview``, ``bytearray``), described by address.

mx's Rust side takes an address and a length. This module finds them, checks what must hold for
mx to use them (host memory, C-contiguous, the range inside the object's storage), keeps a
reference to the object so the memory stays allocated, and checks again before each use that
nothing moved: a tensor resized (``resize_``), re-pointed (``.data = ...``, ``set_``) or
re-typed after registration is an error naming it, not a read of freed memory.

Conventions: dtypes are safetensors names (``"BF16"``, ``"F32"``, ...), the names mx's Rust
side parses; shapes and strides are in elements (torch's convention; numpy's byte strides are
converted).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from . import _mx

# torch dtype name (str(dtype) without "torch.") and numpy dtype name -> safetensors name.
_DTYPES = {
    "bool": "BOOL",
    "uint8": "U8",
    "int8": "I8",
    "int16": "I16",
    "int32": "I32",
    "int64": "I64",
    "float16": "F16",
    "bfloat16": "BF16",
    "float32": "F32",
    "float64": "F64",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
}


def _error(message: str, code: str) -> _mx.MxError:
    err = _mx.MxError(message)
    err.code = code
    return err


@dataclass(frozen=True)
class Region:
    """Host memory of one object, as registered.

    ``addr``/``nbytes``: the bytes mx uses; ``dtype`` (safetensors name, or None for an
    untyped byte buffer), ``shape`` and ``strides`` (elements) as the object says;
    ``storage``: ``(address, bytes)`` of the allocation the range lies in.
    """

    what: str
    addr: int
    nbytes: int
    dtype: str | None
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    storage: tuple[int, int]
    #: The object itself (kept referenced so its memory stays allocated).
    owner: Any
    #: What else keeps the memory allocated (a torch tensor's storage: it survives
    #: ``tensor.data = other``).
    keepalive: Any = None

    def identity(self) -> tuple[int, int, str | None, tuple[int, ...], tuple[int, ...], tuple]:
        return (self.addr, self.nbytes, self.dtype, self.shape, self.strides, self.storage)


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for d in reversed(shape):
        strides.append(acc)
        acc *= max(d, 1)
    return tuple(reversed(strides))


def _is_torch(obj: Any) -> bool:
    return type(obj).__module__.startswith("torch") and hasattr(obj, "untyped_storage")


def _torch_region(t: Any, what: str, writable: bool) -> Region:
    if t.device.type != "cpu":
        raise _error(
            f"{what}: a {t.device.type} tensor; this build of mx takes host (CPU) memory from "
            "Python (device memory goes through the Rust and C APIs built with the cuda "
            "feature)",
            "InvalidArgument",
        )
    if str(t.layout) != "torch.strided":
        raise _error(f"{what}: a {t.layout} tensor; mx needs a dense tensor", "InvalidArgument")
    if not t.is_contiguous():
        raise _error(
            f"{what}: not contiguous (shape {tuple(t.shape)}, strides {tuple(t.stride())}); "
            "mx reads and writes row-major bytes in place: pass a contiguous tensor "
            "(.contiguous() makes a copy, which mx would then not see change)",
            "InvalidArgument",
        )
    name = str(t.dtype).removeprefix("torch.")
    dtype = _DTYPES.get(name)
    if dtype is None:
        raise _error(f"{what}: dtype {t.dtype} has no mx equivalent", "InvalidArgument")
    storage = t.untyped_storage()
    nbytes = t.numel() * t.element_size()
    addr = t.data_ptr()
    base, size = storage.data_ptr(), storage.nbytes()
    if nbytes and not (base <= addr and addr + nbytes <= base + size):
        raise _error(
            f"{what}: its bytes {addr:#x}+{nbytes} lie outside its storage {base:#x}+{size}",
            "InvalidArgument",
        )
    return Region(
        what,
        addr,
        nbytes,
        dtype,
        tuple(int(d) for d in t.shape),
        tuple(int(s) for s in t.stride()),
        (base, size),
        t,
        storage,
    )


def _array_interface_region(obj: Any, what: str, writable: bool) -> Region:
    ai = obj.__array_interface__
    addr, readonly = ai["data"]
    if writable and readonly:
        raise _error(f"{what}: read-only memory; mx writes into it", "InvalidArgument")
    shape = tuple(int(d) for d in ai["shape"])
    import numpy as np  # only reached for numpy-like objects

    dt = np.dtype(ai["typestr"])
    itemsize = dt.itemsize
    strides = ai.get("strides")
    contiguous = _contiguous_strides(shape)
    if strides is not None and tuple(strides) != tuple(s * itemsize for s in contiguous):
        raise _error(
            f"{what}: not C-contiguous (shape {shape}, byte strides {tuple(strides)}); "
            "pass a C-contiguous array",
            "InvalidArgument",
        )
    if dt.byteorder == ">":
        raise _error(f"{what}: big-endian data; mx needs little-endian", "InvalidArgument")
    dtype = _DTYPES.get(dt.name)
    if dtype is None:
        raise _error(f"{what}: dtype {dt} has no mx equivalent", "InvalidArgument")
    nbytes = itemsize
    for d in shape:
        nbytes *= d
    return Region(what, int(addr), nbytes, dtype, shape, contiguous, (int(addr), nbytes), obj)


def _buffer_region(obj: Any, what: str, writable: bool) -> Region:
    try:
        mv = memoryview(obj)
    except TypeError:
        raise _error(
            f"{what}: a {type(obj).__name__} is neither a torch tensor, an array (numpy, "
            "__array_interface__, __dlpack__) nor a buffer",
            "InvalidArgument",
        ) from None
    if not mv.c_contiguous:
        raise _error(f"{what}: the buffer is not C-contiguous", "InvalidArgument")
    if writable and mv.readonly:
        raise _error(f"{what}: read-only buffer; mx writes into it", "InvalidArgument")
    import numpy as np

    arr = np.frombuffer(mv.cast("B"), dtype=np.uint8)
    addr = int(arr.__array_interface__["data"][0])
    shape = (mv.nbytes,)
    # A raw byte buffer is untyped: only its length is checked against the layout.
    return Region(what, addr, mv.nbytes, None, shape, (1,), (addr, mv.nbytes), obj, mv)


def describe(obj: Any, what: str, *, writable: bool) -> Region:
    """The host memory of ``obj`` (a torch tensor, a numpy array or anything with
    ``__array_interface__``, an object with ``__dlpack__`` on CPU, or a C-contiguous buffer).

    Args:
        what: how errors name it (e.g. ``"tensor model.norm.weight (slot 0)"``).
        writable: mx will write into it (a puller's destination).

    Raises:
        MxError: (``code`` ``"InvalidArgument"``) device memory, non-contiguous, read-only
            when ``writable``, a dtype mx does not know, a range outside its storage.
    """
    if _is_torch(obj):
        return _torch_region(obj, what, writable)
    if hasattr(obj, "__array_interface__"):
        return _array_interface_region(obj, what, writable)
    if hasattr(obj, "__dlpack__") and not isinstance(obj, (bytes, bytearray, memoryview)):
        import numpy as np

        try:
            arr = np.from_dlpack(obj)
        except (BufferError, RuntimeError, TypeError) as e:
            raise _error(
                f"{what}: cannot view it through DLPack on the host: {e}", "InvalidArgument"
            ) from None
        region = _array_interface_region(arr, what, writable)
        return dataclasses.replace(region, owner=obj, keepalive=arr)
    return _buffer_region(obj, what, writable)


def check_unchanged(region: Region) -> None:
    """Checks that ``region.owner`` still has the memory it was registered with.

    Raises:
        MxError: (``code`` ``"FailedPrecondition"``) naming the object and what changed
            (address, size, dtype, shape, strides or storage).
    """
    try:
        now = describe(region.owner, region.what, writable=False)
    except _mx.MxError as e:
        raise _error(f"{e} (it changed since it was registered)", "FailedPrecondition") from None
    if now.identity() == region.identity():
        return
    fields = ("address", "bytes", "dtype", "shape", "strides", "storage")
    changed = [
        f"{f} {a!r} -> {b!r}"
        for f, a, b in zip(fields, region.identity(), now.identity(), strict=True)
        if a != b
    ]
    raise _error(
        f"{region.what} changed since it was registered ({'; '.join(changed)}): mx reads and "
        "writes the memory it registered, so a tensor must keep its storage, shape and dtype "
        "(update it in place, e.g. with an optimizer step or copy_(); register again after "
        "replacing it)",
        "FailedPrecondition",
    )
