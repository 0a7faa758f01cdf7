"""CUDA plumbing for the DeviceLoader, and its stand-ins when there is no CUDA.

Owns cudaHostRegister/cudaHostUnregister of the host pool, the device-side
view of that registered memory (what a gather kernel reads through), and the
completed-event / null-stream stand-ins of the CPU fallback. Must not plan or
issue copies: `plan` and `copies` do that.
"""
import contextlib

import torch

# cudaHostRegister flags. Portable: every context may use it. Mapped: the pool
# also gets a device address, so kernels can read it over PCIe (zero-copy).
HOST_REGISTER_PORTABLE = 1
HOST_REGISTER_MAPPED = 2


class HostRegistration:
    """Pins a host range for DMA (and maps it) until `close()`.

    Without this, `copy_(non_blocking=True)` from the shm pool would go through
    the driver's pageable path: a synchronous bounce through a staging buffer.
    """

    def __init__(self, ptr: int, nbytes: int):
        self.ptr, self.nbytes = ptr, nbytes
        rt = torch.cuda.cudart()
        err = rt.cudaHostRegister(ptr, nbytes, HOST_REGISTER_PORTABLE | HOST_REGISTER_MAPPED)
        if err != rt.cudaError.success:
            raise RuntimeError(f"cudaHostRegister({nbytes} bytes) failed: {err} (already registered "
                               "means a second loader over the same pool)")
        self.active = True

    def close(self) -> None:
        if self.active:
            self.active = False
            torch.cuda.cudart().cudaHostUnregister(self.ptr)


class _CudaArray:
    """Just enough of __cuda_array_interface__ for torch to wrap a device address."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "strides": None, "version": 3}


def mapped_bytes(ptr: int, nbytes: int, device) -> torch.Tensor | None:
    """The registered host range as a uint8 CUDA tensor, or None if it cannot be had.

    With unified addressing (every 64-bit Linux CUDA system) a registered host
    pointer is also its device pointer; torch accepts it because
    cudaPointerGetAttributes reports the range as registered host memory.
    Kernels that read this tensor pull the bytes over PCIe.
    """
    try:
        with torch.cuda.device(device):
            t = torch.as_tensor(_CudaArray(ptr, nbytes), device=device)
        return t if t.data_ptr() == ptr else None
    except Exception:  # an old driver or a platform without host-pointer mapping: DMA only
        return None


class DoneEvent:
    """An event that has always completed: the CPU fallback copies synchronously."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


DONE = DoneEvent()


def stream_context(stream):
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
