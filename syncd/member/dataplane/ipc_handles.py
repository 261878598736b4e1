"""CUDA IPC memory handles through the driver API (libcuda, by ctypes), not torch's reductions.

torch's `reduce_tensor` keeps every shared block alive in the sender until each receiver that
opened it has decremented a shared counter; a receiver killed before it did never does, and the
sender then holds that memory until it exits (measured: a killed receiver left 96 MB of a 100 MB
model allocated in the sender after it freed its weights). A bare driver handle carries no such
bookkeeping: the sender's allocator frees its memory as it always does, the driver keeps an
allocation's pages while any process still maps them, and a process's mappings end with it.

What this gives up is torch's guard against the sender reusing memory a receiver still reads;
the refit protocol is that guard instead (the sender holds its weights from its offer until the
receiver's "done"), and a stale mapping cannot pass unnoticed: the receiver's checksums are of
what it copied, the sender's of what it holds, and syncd compares them.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

HANDLE_BYTES = 64  # sizeof(CUipcMemHandle)
_LAZY_ENABLE_PEER_ACCESS = 1  # cuIpcOpenMemHandle's only flag


class _Handle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * HANDLE_BYTES)]


_driver: ctypes.CDLL | None = None


def _cuda() -> ctypes.CDLL:
    """libcuda, loaded on first use (the process has a CUDA context by then: torch made it)."""
    global _driver
    if _driver is None:
        lib = ctypes.CDLL("libcuda.so.1")
        ptr, size = ctypes.c_uint64, ctypes.c_size_t
        lib.cuMemGetAddressRange_v2.argtypes = [ctypes.POINTER(ptr), ctypes.POINTER(size), ptr]
        lib.cuIpcGetMemHandle.argtypes = [ctypes.POINTER(_Handle), ptr]
        lib.cuIpcOpenMemHandle_v2.argtypes = [ctypes.POINTER(ptr), _Handle, ctypes.c_uint]
        lib.cuIpcCloseMemHandle.argtypes = [ptr]
        lib.cuGetErrorName.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        _driver = lib
    return _driver


def _check(result: int, what: str) -> None:
    if result:
        name = ctypes.c_char_p()
        _cuda().cuGetErrorName(result, ctypes.byref(name))
        raise RuntimeError(f"{what}: CUDA error {result} ({(name.value or b'?').decode()})")


@dataclass(frozen=True)
class Export:
    """A tensor as another process on this GPU opens it: the handle of the allocation it lies in,
    where it starts there (bytes), and its dtype, shape and strides."""

    handle: bytes
    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]

    @property
    def span(self) -> int:
        """Bytes from its first element to the end of its last."""
        if not all(self.shape):
            return 0
        last = sum((n - 1) * s for n, s in zip(self.shape, self.stride))
        return (last + 1) * torch.empty(0, dtype=self.dtype).element_size()


def export(tensor: torch.Tensor) -> Export:
    """`tensor`'s export (a CUDA tensor in memory of cudaMalloc: not of expandable segments)."""
    lib = _cuda()
    with torch.cuda.device(tensor.device):
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        _check(
            lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), tensor.data_ptr()),
            "allocation",
        )
        handle = _Handle()
        _check(lib.cuIpcGetMemHandle(ctypes.byref(handle), base.value), "cuIpcGetMemHandle")
    raw = ctypes.string_at(ctypes.addressof(handle), HANDLE_BYTES)
    return Export(
        raw, tensor.data_ptr() - base.value, tensor.dtype, tuple(tensor.shape), tuple(tensor.stride())
    )


class _Bytes:
    """The bytes at a device address, as torch takes foreign memory (without owning it)."""

    def __init__(self, address: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (address, False),
            "version": 2,
        }


class Opened:
    """An allocation of another process, mapped here until `close` (its tensors must be gone,
    and no work reading them pending, by then)."""

    def __init__(self, handle: bytes) -> None:
        address = ctypes.c_uint64()
        raw = _Handle.from_buffer_copy(handle)
        _check(
            _cuda().cuIpcOpenMemHandle_v2(ctypes.byref(address), raw, _LAZY_ENABLE_PEER_ACCESS),
            "cuIpcOpenMemHandle",
        )
        self.address: int | None = address.value

    def tensor(self, e: Export) -> torch.Tensor:
        if self.address is None:
            raise RuntimeError("cuda ipc: the allocation was closed")
        if not e.span:
            return torch.empty(e.shape, dtype=e.dtype, device="cuda")
        raw = torch.as_tensor(_Bytes(self.address + e.offset, e.span), device="cuda")
        return raw.view(e.dtype).as_strided(e.shape, e.stride)

    def close(self) -> None:
        if self.address is not None:
            address, self.address = self.address, None
            _check(_cuda().cuIpcCloseMemHandle(address), "cuIpcCloseMemHandle")
