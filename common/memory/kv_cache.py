"""The paged KV cache: per-layer K and V buffers indexed by slot."""

from __future__ import annotations

import weakref

import torch

# Every KV cache alive in this process (for `reserved_bytes`).
_live_caches: weakref.WeakSet[PagedKVCache] = weakref.WeakSet()


def _is_one_byte_float(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point and dtype.itemsize == 1


class PagedKVCache:
    """K and V of every token of every layer, in the storage dtype (which may be an fp8 flavour).

    An fp8 cache stores K / k_scale and V / v_scale with one scale per layer for each (a checkpoint's `k_scale` and
    `v_scale`, 1.0 where it has none; `set_scales`), so that keys and values beyond the fp8 range fit. Readers get the
    stored values: attention over K and V is attention over the stored ones with the softmax scale times k_scale and the
    output times v_scale (omnirun.layers.attention.PagedAttention folds the scales in that way for every backend).

    Slots 0..page_size-1 (page 0) are the padding page: zeroed here and never handed out, so kernels may point
    padded entries at slot 0. The rest is left uninitialised, because zeroing a multi-GB pool costs start-up time.
    """

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        page_size: int = 1,
    ):
        for name, value in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if num_slots < page_size:
            raise ValueError(f"num_slots ({num_slots}) must hold at least the padding page ({page_size} slots)")
        self.num_layers = num_layers
        self.num_slots = num_slots
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self.page_size = page_size
        self.k_scales = [1.0] * num_layers
        self.v_scales = [1.0] * num_layers
        shape = (num_slots, num_kv_heads, head_dim)
        self.k_buffers = [torch.empty(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self.v_buffers = [torch.empty(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        for buf in self.k_buffers + self.v_buffers:
            buf[:page_size].zero_()
        _live_caches.add(self)

    @staticmethod
    def reserved_bytes(device_type: str) -> int:
        """Bytes of the KV caches alive in this process on devices of `device_type`. Host memory is committed
        only when first touched, so a host memory probe does not see a pool that is still untouched: such a
        platform subtracts this from what it reports free (counting touched pages twice errs on the safe side)."""
        return sum(cache.nbytes for cache in list(_live_caches) if cache.device.type == device_type)

    @property
    def quantized(self) -> bool:
        """Whether the storage dtype is an fp8 flavour (the only one the per-layer scales apply to)."""
        return _is_one_byte_float(self.dtype)

    def set_scales(self, k_scales: list[float], v_scales: list[float]) -> None:
        """The per-layer scales an fp8 cache stores with (before any token is stored: tokens stored under other
        scales would read wrong)."""
        if not self.quantized:
            raise ValueError(f"a {str(self.dtype).removeprefix('torch.')} KV cache stores unscaled values")
        if len(k_scales) != self.num_layers or len(v_scales) != self.num_layers:
            raise ValueError(f"one k and one v scale per layer: {self.num_layers} each")
        if not all(s > 0 and s != float("inf") for s in (*k_scales, *v_scales)):
            raise ValueError("KV cache scales must be positive and finite")
        self.k_scales, self.v_scales = [float(s) for s in k_scales], [float(s) for s in v_scales]

    def scales(self, layer_id: int) -> tuple[float, float]:
        """(k_scale, v_scale) of a layer: stored values times these are the keys and values."""
        return self.k_scales[layer_id], self.v_scales[layer_id]

    def set_kv(self, layer_id: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store `k`, `v` ([n, num_kv_heads, head_dim], model dtype) at `slots` of layer `layer_id`.

        Values are cast to the storage dtype; fp8 stores k / k_scale and v / v_scale, divided in float32 (as vLLM's
        cache kernels do), and does not clamp: values beyond the fp8 range become what a plain cast makes of them.
        """
        if k.shape != v.shape or k.shape[1:] != (self.num_kv_heads, self.head_dim):
            raise ValueError(
                f"k and v must be [n, {self.num_kv_heads}, {self.head_dim}], got {tuple(k.shape)} and {tuple(v.shape)}"
            )
        slots = slots.to(device=self.device, dtype=torch.int64, non_blocking=True)
        k_buf, v_buf = self.k_buffers[layer_id], self.v_buffers[layer_id]
        k_scale, v_scale = self.scales(layer_id)
        if k_scale != 1.0:
            k = k.float() / k_scale
        if v_scale != 1.0:
            v = v.float() / v_scale
        k, v = k.to(self.dtype), v.to(self.dtype)
        if _is_one_byte_float(self.dtype):
            # Indexed stores are not implemented for fp8 on every device; the byte view stores the same bits.
            k_buf, v_buf, k, v = (t.view(torch.uint8) for t in (k_buf, v_buf, k, v))
        k_buf[slots] = k
        v_buf[slots] = v

    def get_kv(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole K and V buffers of one layer, [num_slots, num_kv_heads, head_dim], in the storage dtype."""
        return self.k_buffers[layer_id], self.v_buffers[layer_id]

    @property
    def nbytes(self) -> int:
        """Bytes held by all K and V buffers."""
        return self.num_slots * self.bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim, self.dtype)

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Bytes one token's K and V take over all layers."""
        return 2 * num_layers * num_kv_heads * head_dim * dtype.itemsize
