"""SGLang host-pool page layouts as views in hicache_mp's logical page order.

Owns the mapping from SGLang's MHA/MLA host layouts (0.5.23
`mem_cache/pool_host/mha.py`, `mla.py`) to `[kv, layer, token, head, dim]`
views: of a page inside a host pool's `kv_buffer`, and of a flat page in the
host layout's own byte order (what `get_data_page(flat=True)` returns and
what SGLang's `file` backend stores, header-less). Imports neither SGLang nor
torch (it only calls tensor methods), so the store importer works without
SGLang. Must not copy: every function returns a view.

    host layout         MHA kv_buffer dims              MLA kv_buffer dims
    layer_first         (2, L, size, H, D)              (L, size, 1, d)
    page_first          (2, size, L, H, D)              (size, L, 1, d)
    page_first_direct   (2, page_num, L, P, H, D)       (page_num, L, P, 1, d)
    page_head           (2, page_num, H, P, L, D)       -
"""
RAW_LAYOUTS = ("page_first", "layer_first", "page_first_direct", "page_head")


def host_page_view(host_pool, page: int, is_mla: bool):
    """SGLang host page `page` as a [kv, layer, token, head, dim] view (no copy)."""
    buf, layout, P = host_pool.kv_buffer, host_pool.layout, int(host_pool.page_size)
    i = page * P
    if is_mla:
        if layout == "layer_first":
            return buf[:, i:i + P].unsqueeze(0)
        if layout == "page_first":
            return buf[i:i + P].transpose(0, 1).unsqueeze(0)
        if layout == "page_first_direct":
            return buf[page].unsqueeze(0)
    else:
        if layout == "layer_first":
            return buf[:, :, i:i + P]
        if layout == "page_first":
            return buf[:, i:i + P].transpose(1, 2)
        if layout == "page_first_direct":
            return buf[:, page]
        if layout == "page_head":
            return buf[:, page].permute(0, 3, 2, 1, 4)
    raise ValueError(f"hicache_mp: unsupported SGLang host layout {layout!r} "
                     f"({'MLA' if is_mla else 'MHA'})")


def flat_page_view(flat, layout: str, geometry):
    """A flat page in SGLang's host-layout byte order as a [kv, layer, token, head, dim] view.

    MLA pages (geometry.mla: kv=1, heads=1) follow the same rule: SGLang's MLA
    flat page is the MHA one without the leading kv axis.
    """
    kv, L, P, H, D = geometry.page_shape
    if layout in ("layer_first", "page_first_direct"):
        return flat.view(kv, L, P, H, D)
    if layout == "page_first":
        return flat.view(kv, P, L, H, D).transpose(1, 2)
    if layout == "page_head" and not geometry.mla:
        return flat.view(kv, H, P, L, D).permute(0, 3, 2, 1, 4)
    raise ValueError(f"hicache_mp: unsupported SGLang host layout {layout!r} "
                     f"(known: {', '.join(RAW_LAYOUTS)})")
