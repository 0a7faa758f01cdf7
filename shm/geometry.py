"""Page geometry: the one place for KV-page byte math.

Owns sizes, the two host layouts, the canonical on-disk order and the
fingerprint that ties a file to a geometry. Pure integer math, torch-free:
workers use it to build iovecs; `HostPool` uses it to shape torch views.
Must not allocate or map memory.

Logical page order (also the canonical file order): ``[kv][layer][token][head][dim]``
with kv in {K, V} (one latent buffer for MLA).

- ``page_first``: the pool is ``[page][kv][layer][token][head][dim]``; a page is
  one contiguous run.
- ``layer_first``: the pool is ``[kv][layer][page*token][head][dim]``; a page is
  ``kv*layers`` runs of ``page_size*heads*dim`` elements, one per (kv, layer).
  Byte for byte SGLang's MHA/MLA ``layer_first`` host layout.
- ``page_first_direct``: the pool is ``[kv][page][layer][token][head][dim]``; a
  page is ``kv`` runs (K, then V). Byte for byte SGLang's ``page_first_direct``
  host layout; added so workers can read straight into an SGLang host pool
  (hicache_mp.integrations.sglang). SGLang's own ``page_first`` is token-major
  (``[kv][token][layer]...``) and is not a few canonical runs, so it has no
  variant here.
"""
from dataclasses import dataclass, field
import hashlib

# The two engine layouts, plus page_first_direct for SGLang host pools (see above).
LAYOUTS = ("page_first", "layer_first", "page_first_direct")

# Byte sizes by dtype name, so workers never need torch to do the math.
DTYPE_SIZES = {
    "bfloat16": 2, "float16": 2, "float32": 4, "float64": 8,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "uint8": 1, "int8": 1,
}


def dtype_name(dtype) -> str:
    """Accept a torch dtype or its name ('bfloat16', 'torch.bfloat16')."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_SIZES:
        raise ValueError(f"unsupported dtype {dtype!r}; known: {sorted(DTYPE_SIZES)}")
    return name


@dataclass(frozen=True)
class PageGeometry:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: str = "bfloat16"
    layout: str = "page_first"
    mla: bool = False  # MLA: one latent buffer per layer instead of K and V
    kv_count: int = field(init=False)

    def __post_init__(self):
        object.__setattr__(self, "dtype", dtype_name(self.dtype))
        for name in ("num_layers", "num_kv_heads", "head_dim", "page_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"PageGeometry.{name} must be a positive int, got {value!r}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {self.layout!r}")
        object.__setattr__(self, "kv_count", 1 if self.mla else 2)

    # --- sizes -------------------------------------------------------------
    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype]

    @property
    def run_bytes(self) -> int:
        """Bytes of one (kv, layer) slice of a page."""
        return self.page_size * self.num_kv_heads * self.head_dim * self.itemsize

    @property
    def page_bytes(self) -> int:
        return self.kv_count * self.num_layers * self.run_bytes

    @property
    def token_bytes(self) -> int:
        return self.page_bytes // self.page_size

    @property
    def page_shape(self) -> tuple:
        """Logical shape of one page: [kv, layer, token, head, dim]."""
        return (self.kv_count, self.num_layers, self.page_size, self.num_kv_heads, self.head_dim)

    def pool_shape(self, num_pages: int) -> tuple:
        kv, layers, tokens, heads, dim = self.page_shape
        if self.layout == "page_first":
            return (num_pages, kv, layers, tokens, heads, dim)
        if self.layout == "page_first_direct":
            return (kv, num_pages, layers, tokens, heads, dim)
        return (kv, layers, num_pages * tokens, heads, dim)

    def pool_bytes(self, num_pages: int) -> int:
        return num_pages * self.page_bytes

    # --- where a page's bytes live in the pool -----------------------------
    def page_runs(self, page: int, num_pages: int) -> list[tuple[int, int]]:
        """(offset, length) runs of pool bytes for `page`, in canonical order.

        A worker turns these into one `preadv`/`pwritev`; canonical order is
        what makes files portable across layouts.
        """
        if self.layout == "page_first":
            return [(page * self.page_bytes, self.page_bytes)]
        if self.layout == "page_first_direct":
            half = self.num_layers * self.run_bytes  # one kv part of one page
            return [(kv * num_pages * half + page * half, half) for kv in range(self.kv_count)]
        run = self.run_bytes
        stride = num_pages * run  # bytes of one (kv, layer) plane
        return [(plane * stride + page * run, run) for plane in range(self.kv_count * self.num_layers)]

    # --- identity ----------------------------------------------------------
    def fingerprint(self) -> bytes:
        """16 bytes naming what a page's payload means, whatever the layout.

        Layout is left out on purpose: files are stored in canonical order,
        so a page written under one layout is valid under the other.
        """
        text = (f"kv={self.kv_count};layers={self.num_layers};heads={self.num_kv_heads};"
                f"dim={self.head_dim};page={self.page_size};dtype={self.dtype}")
        return hashlib.sha256(text.encode()).digest()[:16]

    def to_dict(self) -> dict:
        return {"num_layers": self.num_layers, "num_kv_heads": self.num_kv_heads,
                "head_dim": self.head_dim, "page_size": self.page_size,
                "dtype": self.dtype, "layout": self.layout, "mla": self.mla}

    @classmethod
    def from_dict(cls, d: dict) -> "PageGeometry":
        return cls(**d)

    def with_layout(self, layout: str) -> "PageGeometry":
        return PageGeometry(**{**self.to_dict(), "layout": layout})

    # --- layer parts (a page file read in several pieces, decision 101) ------
    def layer_part(self, parts: int) -> "PageGeometry":
        """The geometry of one of `parts` equal layer groups of this page: what
        a host slot holds when a page file is read a layer group at a time."""
        if not isinstance(parts, int) or isinstance(parts, bool) or parts <= 0:
            raise ValueError(f"parts must be a positive int, got {parts!r}")
        if self.num_layers % parts:
            raise ValueError(f"{self.num_layers} layers do not split into {parts} equal "
                             f"layer groups; choose a divisor of {self.num_layers}")
        return PageGeometry(**{**self.to_dict(), "num_layers": self.num_layers // parts})

    def part_file_ranges(self, parts: int, part: int) -> list[tuple[int, int]]:
        """(payload offset, length) of layer group `part` of `parts` in the page's
        canonical order [kv][layer]...: one run per kv (K then V; one for MLA)."""
        group = self.layer_part(parts).num_layers
        if not 0 <= part < parts:
            raise ValueError(f"part {part} out of range [0, {parts})")
        return [((kv * self.num_layers + part * group) * self.run_bytes, group * self.run_bytes)
                for kv in range(self.kv_count)]
