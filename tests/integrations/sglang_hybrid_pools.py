"""CPU host pools with SGLang 0.5.23's sidecar host-pool interface and memory.

SGLang's own MambaPoolHost, DSAIndexerPoolHost, MHA/MLA host pools cannot be
built here for the reason `sglang_pool.py` gives (sglang.srt.mem_cache.pool_host
-> memory_pool -> sglang.srt.configs -> transformers, then
sglang/srt/multimodal/internvl_utils.py imports torchvision, whose only PyPI
build for torch 2.13 is the CUDA one: "operator torchvision::nms does not
exist" against torch 2.13.0+cpu). Checked again for this file: with
transformers 5.24 installed beside SGLang, `import sglang.srt.mem_cache.pool_host.mamba`
stops at `import torchvision.transforms`.

So each class below reproduces what a backend reads from the real pool
(0.5.23 `mem_cache/pool_host/mamba.py`, `dsa.py`, `mla.py`): buffer dims per
layout, page_size, `get_data_page`, `get_dummy_flat_data_page`,
`set_from_flat_data_page`, and the shm allocator's fds (one memfd per tensor:
a Mamba state is a fp32 temporal tensor plus bf16 conv tensors, each its own
`alloc_shm`). Memory comes from SGLang's own `alloc_shm`.
"""
import os

import numpy as np
import torch

from sglang_pool import CpuMHAHostPool, ShmAllocator  # noqa: F401  (re-exported)


class _Closing:
    def close(self):
        for fd in getattr(self.allocator, "fds", []):
            os.close(fd)
        self.allocator.fds = []


class CpuMambaHostPool(_Closing):
    """mamba.py MambaPoolHost, page_first: one slot = one page (page_size 1)."""

    def __init__(self, *, layers=2, slots=8, temporal_shape=(2, 4, 4), conv_shapes=((3, 8),),
                 layout="page_first"):
        assert layout in ("page_first", "page_first_direct")
        self.layout, self.page_size, self.size = layout, 1, slots
        self.device, self.pin_memory = "cpu", False
        self.num_mamba_layers = layers
        self.temporal_dtype, self.conv_dtype = torch.float32, torch.bfloat16
        self.temporal_state_shape = tuple(temporal_shape)
        self.conv_state_shapes = [tuple(s) for s in conv_shapes]
        self.temporal_state_elem_size = int(np.prod(self.temporal_state_shape))
        self.conv_state_elem_sizes = [int(np.prod(s)) for s in self.conv_state_shapes]
        self.slot_state_device_tensors = ()
        self.slot_state_buffers = ()
        self.allocator = ShmAllocator()
        self.temporal_buffer = self.allocator.allocate(
            (slots, layers, 1) + self.temporal_state_shape, self.temporal_dtype, "cpu")
        self.conv_buffer = [self.allocator.allocate((slots, layers, 1) + s, self.conv_dtype, "cpu")
                            for s in self.conv_state_shapes]
        self.fd = self.allocator.fd
        self.size_per_token = self.get_size_per_token()

    def get_size_per_token(self):
        conv = sum(e * self.conv_dtype.itemsize for e in self.conv_state_elem_sizes)
        temporal = self.temporal_state_elem_size * self.temporal_dtype.itemsize
        return (conv + temporal) * self.num_mamba_layers

    def _iter_page_tensors(self, index):
        yield self.temporal_buffer[index]
        for conv_buf in self.conv_buffer:
            yield conv_buf[index]

    def get_data_page(self, index, flat=True):
        page = torch.cat([t.contiguous().view(torch.uint8).reshape(-1)
                          for t in self._iter_page_tensors(index)])
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self):
        return torch.zeros(self.page_size * self.size_per_token, dtype=torch.uint8)

    def set_from_flat_data_page(self, index, data_page):
        flat = data_page.contiguous().view(torch.uint8).reshape(-1)
        start = 0
        for tensor in self._iter_page_tensors(index):
            n = tensor.numel() * tensor.element_size()
            chunk = flat[start:start + n]
            start += n
            if chunk.storage_offset() % tensor.element_size():
                chunk = chunk.clone()
            tensor.copy_(chunk.view(dtype=tensor.dtype).reshape(tensor.shape))

    def fill_random(self, gen):
        self.temporal_buffer.copy_(torch.randn(self.temporal_buffer.shape, generator=gen))
        for c in self.conv_buffer:
            c.copy_(torch.randn(c.shape, generator=gen).to(c.dtype))

    def slot_indices(self, slots):
        return torch.tensor(list(slots), dtype=torch.int64)


class CpuDSAIndexerHostPool(_Closing):
    """dsa.py DSAIndexerPoolHost: uint8 index_k_with_scale_buffer, token-indexed
    by the KV pool's host indices (page = index // page_size)."""

    def __init__(self, *, layers=2, page_size=4, pages=12, stride=24, layout="page_first"):
        self.layout, self.page_size, self.layer_num = layout, page_size, layers
        self.device, self.pin_memory = "cpu", False
        self.indexer_dtype = torch.uint8
        self.indexer_page_stride_size = stride
        self.indexer_page_num = pages
        self.allocator = ShmAllocator()
        dims = ((layers, pages, stride) if layout == "layer_first" else (pages, layers, 1, stride))
        self.index_k_with_scale_buffer = self.allocator.allocate(dims, torch.uint8, "cpu")
        self.fd = self.allocator.fd

    def get_data_page(self, index, flat=True):
        p = int(index) // self.page_size
        if self.layout == "layer_first":
            page = self.index_k_with_scale_buffer[:, p:p + 1, :]
        else:
            page = self.index_k_with_scale_buffer[p:p + 1, :, :, :]
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self):
        return torch.zeros((self.layer_num, self.indexer_page_stride_size),
                           dtype=self.indexer_dtype).flatten()

    def set_from_flat_data_page(self, index, data_page):
        p = int(index) // self.page_size
        if self.layout == "layer_first":
            self.index_k_with_scale_buffer[:, p:p + 1, :] = data_page.reshape(
                self.layer_num, 1, self.indexer_page_stride_size)
        else:
            self.index_k_with_scale_buffer[p:p + 1, :, :, :] = data_page.reshape(
                1, self.layer_num, 1, self.indexer_page_stride_size)

    def fill_random(self, gen):
        b = self.index_k_with_scale_buffer
        b.copy_(torch.randint(0, 256, b.shape, generator=gen, dtype=torch.uint8))

    def token_indices(self, pages):
        P = self.page_size
        return torch.cat([torch.arange(p * P, (p + 1) * P, dtype=torch.int64) for p in pages])


class CpuMLAHostPool(_Closing):
    """mla.py MLATokenToKVPoolHost (a DeepSeek V4 compressed pool is one of these)."""

    def __init__(self, *, layers=2, page_size=4, pages=12, dim=20, layout="layer_first",
                 dtype=torch.bfloat16):
        self.layer_num, self.page_size, self.layout, self.dtype = layers, page_size, layout, dtype
        self.kv_cache_dim = dim
        self.device, self.pin_memory = "cpu", False
        self.page_num, self.size = pages, pages * page_size
        self.allocator = ShmAllocator()
        if layout == "layer_first":
            dims = (layers, self.size, 1, dim)
        elif layout == "page_first":
            dims = (self.size, layers, 1, dim)
        else:
            dims = (pages, layers, page_size, 1, dim)
        self.kv_buffer = self.allocator.allocate(dims, dtype, "cpu")
        self.fd = self.allocator.fd

    def get_data_page(self, index, flat=True):
        if self.layout == "layer_first":
            page = self.kv_buffer[:, index:index + self.page_size]
        elif self.layout == "page_first":
            page = self.kv_buffer[index:index + self.page_size]
        else:
            r = index // self.page_size
            page = self.kv_buffer[r:r + 1]
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self):
        return torch.zeros((self.layer_num, self.page_size, 1, self.kv_cache_dim),
                           dtype=self.dtype).flatten()

    def set_from_flat_data_page(self, index, data_page):
        L, P, d = self.layer_num, self.page_size, self.kv_cache_dim
        if self.layout == "layer_first":
            self.kv_buffer[:, index:index + P] = data_page.reshape(L, P, 1, d)
        elif self.layout == "page_first":
            self.kv_buffer[index:index + P] = data_page.reshape(P, L, 1, d)
        else:
            r = index // P
            self.kv_buffer[r:r + 1] = data_page.reshape(1, L, P, 1, d)

    def fill_random(self, gen):
        self.kv_buffer.copy_(torch.randn(self.kv_buffer.shape, generator=gen).to(self.dtype))

    def token_indices(self, pages):
        P = self.page_size
        return torch.cat([torch.arange(p * P, (p + 1) * P, dtype=torch.int64) for p in pages])


def fill_random_mha(pool: CpuMHAHostPool, gen):
    pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape, generator=gen).to(pool.dtype))
