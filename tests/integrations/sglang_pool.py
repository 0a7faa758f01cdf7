"""A CPU host KV pool with SGLang 0.5.23's MHA host-pool interface and memory.

Why not SGLang's own `MHATokenToKVPoolHost`: on this CI (Python 3.11, torch
2.13.0+cpu, `pip install --no-deps`) `sglang.srt.mem_cache.pool_host` cannot be
imported. Its chain is pool_host/__init__ -> pool_host/group.py ->
sglang.srt.mem_cache.memory_pool -> sglang.srt.configs -> transformers (and its
stack), and with transformers present sglang/srt/multimodal/internvl_utils.py
does `import torchvision.transforms`. The only torchvision for torch 2.13 on
PyPI (0.28.0) is the CUDA build (links libtorch_cuda.so / libcudart.so.13) and
fails against torch 2.13.0+cpu with "operator torchvision::nms does not
exist"; the CPU build lives on download.pytorch.org, which CI cannot reach.
The same chain blocks `pool_host.common.ShmHostTensorAllocator`.

So this class reproduces, line for line, what hicache_mp reads from the real
pool (sglang 0.5.23 `mem_cache/pool_host/mha.py` and `base.py`): `init_kv_buffer`
dims, `page_num = size // page_size + 1` sizing, `get_page_buffer_meta`,
`get_data_page`, `get_dummy_flat_data_page`, `set_from_flat_data_page`, and the
`fd` / `allocator.fds` / `allocator.mms` attributes of the shm allocator. The
memory is SGLang's own: `alloc_shm` (a memfd, "allocator": "shm") or
`alloc_mmap` (the default allocator, no fd) from
`sglang.srt.mem_cache.storage.mmap`, imported for real.
"""
import os

import torch

from sglang.srt.mem_cache.storage.mmap import alloc_mmap, alloc_shm


class ShmAllocator:
    """pool_host/common.py ShmHostTensorAllocator: alloc_shm, remembers fds and mms."""

    def __init__(self):
        self.fds, self.mms = [], []

    @property
    def fd(self):
        return self.fds[0] if self.fds else None

    def allocate(self, dims, dtype, device):
        assert device == "cpu"
        tensor, fd, mm = alloc_shm(dims, dtype)
        self.fds.append(fd)
        self.mms.append(mm)
        return tensor


class DefaultAllocator:
    """pool_host/common.py HostTensorAllocator: alloc_mmap, no fd."""

    def allocate(self, dims, dtype, device):
        assert device == "cpu"
        return alloc_mmap(dims, dtype)


class CpuMHAHostPool:
    def __init__(self, *, layer_num=3, head_num=2, head_dim=16, page_size=4, pages=12,
                 layout="layer_first", dtype=torch.bfloat16, allocator_type="shm"):
        self.layer_num, self.head_num, self.head_dim = layer_num, head_num, head_dim
        self.v_head_dim = head_dim
        self.page_size, self.layout, self.dtype = page_size, layout, dtype
        self.device, self.pin_memory = "cpu", False
        # base.py: page_num = size // page_size + 1; size = page_num * page_size
        self.page_num = pages
        self.size = self.page_num * page_size
        self.allocator = ShmAllocator() if allocator_type == "shm" else DefaultAllocator()
        self.kv_buffer = self.init_kv_buffer()
        self.fd = getattr(self.allocator, "fd", None)   # base.py _allocate_host_buffer

    def init_kv_buffer(self):
        if self.layout == "layer_first":
            dims = (2, self.layer_num, self.size, self.head_num, self.head_dim)
        elif self.layout == "page_first":
            dims = (2, self.size, self.layer_num, self.head_num, self.head_dim)
        elif self.layout == "page_first_direct":
            dims = (2, self.page_num, self.layer_num, self.page_size, self.head_num, self.head_dim)
        elif self.layout == "page_head":
            dims = (2, self.page_num, self.head_num, self.page_size, self.layer_num, self.head_dim)
        else:
            raise ValueError(f"Unsupported layout: {self.layout}")
        self.token_stride_size = self.head_num * self.head_dim * self.dtype.itemsize
        self.layout_dim = self.token_stride_size * self.layer_num
        return self.allocator.allocate(dims, self.dtype, self.device)

    @property
    def k_buffer(self):
        return self.kv_buffer[0]

    @property
    def v_buffer(self):
        return self.kv_buffer[1]

    def get_size_per_token(self):
        return (self.head_dim + self.v_head_dim) * self.head_num * self.layer_num * self.dtype.itemsize

    def get_data_page(self, index, flat: bool = True) -> torch.Tensor:
        if self.layout == "layer_first":
            data_page = self.kv_buffer[:, :, index: index + self.page_size, :, :]
        elif self.layout == "page_first":
            data_page = self.kv_buffer[:, index: index + self.page_size, :, :, :]
        elif self.layout in ["page_first_direct", "page_head"]:
            real_index = index // self.page_size
            data_page = self.kv_buffer[:, real_index: real_index + 1, :, :, :, :]
        else:
            raise ValueError(f"Unsupported layout: {self.layout}")
        if flat:
            data_page = data_page.flatten()
        return data_page

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros((2, self.layer_num, self.page_size, self.head_num, self.head_dim),
                           dtype=self.dtype, device=self.device, pin_memory=self.pin_memory).flatten()

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        L, P, H, D = self.layer_num, self.page_size, self.head_num, self.head_dim
        if self.layout == "layer_first":
            self.kv_buffer[:, :, index: index + P, :, :] = data_page.reshape(2, L, P, H, D)
        elif self.layout == "page_first":
            self.kv_buffer[:, index: index + P, :, :, :] = data_page.reshape(2, P, L, H, D)
        elif self.layout == "page_first_direct":
            r = index // P
            self.kv_buffer[:, r: r + 1] = data_page.reshape(2, 1, L, P, H, D)
        elif self.layout == "page_head":
            r = index // P
            self.kv_buffer[:, r: r + 1] = data_page.reshape(2, 1, H, P, L, D)
        else:
            raise ValueError(f"Unsupported layout: {self.layout}")

    def get_page_buffer_meta(self, indices):
        """mha.py 0.5.23, verbatim in substance."""
        assert len(indices) % self.page_size == 0
        ptr_list = []
        kv_buffer_data_ptr = self.kv_buffer.data_ptr()
        indices = indices.tolist()
        it = self.dtype.itemsize
        v_offset = self.layer_num * self.size * self.head_num * self.head_dim * it
        if self.layout == "layer_first":
            for index in range(0, len(indices), self.page_size):
                for layer_id in range(self.layer_num):
                    k_ptr = (kv_buffer_data_ptr
                             + indices[index] * self.head_num * self.head_dim * it
                             + layer_id * self.size * self.head_num * self.head_dim * it)
                    ptr_list.append(k_ptr)
                    ptr_list.append(k_ptr + v_offset)
            element_size = it * self.page_size * self.head_num * self.head_dim
        elif self.layout in ["page_first", "page_first_direct", "page_head"]:
            for index in range(0, len(indices), self.page_size):
                k_ptr = kv_buffer_data_ptr + indices[index] * self.layer_num * self.head_num * self.head_dim * it
                ptr_list.append(k_ptr)
                ptr_list.append(k_ptr + v_offset)
            element_size = self.layer_num * it * self.page_size * self.head_num * self.head_dim
        else:
            raise ValueError(f"Unsupported layout: {self.layout}")
        return ptr_list, [element_size] * len(ptr_list)

    # --- test helpers (not SGLang API) ---------------------------------------
    def token_indices(self, pages) -> torch.Tensor:
        """SGLang's host_indices for whole pages: page_size token slots per page."""
        P = self.page_size
        return torch.cat([torch.arange(p * P, (p + 1) * P, dtype=torch.int64) for p in pages])

    def close(self):
        self.kv_buffer = None
        for fd in getattr(self.allocator, "fds", []):
            os.close(fd)
        if hasattr(self.allocator, "fds"):
            self.allocator.fds = []
