"""A stand-in for torch_npu that follows its documented Python API, to test the npu platform without Ascend hardware.

Signatures follow torch_npu/npu/{__init__,utils,memory,streams}.py (github.com/Ascend/pytorch): every device
argument takes an int, a torch.device or None (the current device), like torch.cuda. The fake records the calls
the platform makes and, like torch_npu's `_lazy_init`, notes when something would have initialised the device.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import types
from pathlib import Path

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from omnirun_fakes.device import RecordingGraph, new_pool

GIB = 1 << 30


class FakeNpu:
    """`torch.npu` (the same object as `torch_npu.npu`)."""

    def __init__(self, device_count: int = 2, device_name: str = "Ascend910B3", bf16: bool = True):
        self.count = device_count
        self.device_name = device_name
        self.bf16 = bf16
        self.current = 0
        self.free, self.total = 40 * GIB, 64 * GIB
        self.peak = 3 * GIB
        self.initialized = False
        self.calls: list[tuple[str, object]] = []

    def _lazy_init(self) -> None:
        self.initialized = True

    def _index(self, device: int | str | torch.device | None) -> int:
        if isinstance(device, str):
            device = torch.device(device)
        if isinstance(device, torch.device):
            assert device.type == "npu", f"expected an npu device, got {device}"
            device = device.index
        return self.current if device is None else device

    def is_available(self) -> bool:
        return self.device_count() > 0

    def device_count(self) -> int:
        # torch_npu asks the driver (ascend_hal) and does not initialise a device.
        return self.count

    def set_device(self, device: int | str | torch.device) -> None:
        self.calls.append(("set_device", device))
        self.current = self._index(device)

    def current_device(self) -> int:
        self._lazy_init()
        return self.current

    def synchronize(self, device: int | torch.device | None = None) -> None:
        self._lazy_init()
        self.calls.append(("synchronize", device))

    def get_device_name(self, device_name: int | torch.device | None = None) -> str:
        self._lazy_init()
        self.calls.append(("get_device_name", device_name))
        return self.device_name

    def is_bf16_supported(self) -> bool:
        self._lazy_init()
        return self.bf16

    def mem_get_info(self, device: int | torch.device | None = None) -> tuple[int, int]:
        self._lazy_init()
        self.calls.append(("mem_get_info", device))
        return self.free, self.total

    def empty_cache(self) -> None:
        self.calls.append(("empty_cache", None))

    def max_memory_allocated(self, device: int | torch.device | None = None) -> int:
        self.calls.append(("max_memory_allocated", device))
        return self.peak

    def reset_peak_memory_stats(self, device: int | torch.device | None = None) -> None:
        self.calls.append(("reset_peak_memory_stats", device))

    def _is_in_bad_fork(self) -> bool:
        return False  # torch.manual_seed asks this before it seeds the PrivateUse1 device through manual_seed_all

    def manual_seed_all(self, seed: int) -> None:
        self.calls.append(("manual_seed_all", seed))

    def Stream(self, device: int | torch.device | None = None, priority: int = 0) -> types.SimpleNamespace:  # noqa: N802
        return types.SimpleNamespace(device_index=self._index(device), priority=priority)

    def Event(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):  # noqa: N802
        return types.SimpleNamespace(enable_timing=enable_timing, blocking=blocking, interprocess=interprocess)


def make_torch_npu(npu: FakeNpu) -> types.ModuleType:
    """The `torch_npu` module around `npu`, with the spec an installed package reports to importlib.util.find_spec."""
    module = types.ModuleType("torch_npu")
    module.__spec__ = importlib.machinery.ModuleSpec("torch_npu", loader=None)
    module.npu = npu
    return module


class BrokenTorchNpuFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Makes torch_npu installed but failing on import with `error`, as it does where CANN is missing."""

    def __init__(self, error: BaseException):
        self.error = error

    def find_spec(self, name, path=None, target=None):
        return importlib.util.spec_from_loader(name, self) if name == "torch_npu" else None

    def create_module(self, spec):
        return None  # the default module object

    def exec_module(self, module):
        raise self.error


def write_importable_torch_npu(directory: Path) -> None:
    """A `torch_npu` package under `directory` whose import registers a FakeNpu the way the real one registers.

    For subprocesses only: the PrivateUse1 rename cannot be undone in a process.
    """
    package = directory / "torch_npu"
    package.mkdir()
    (package / "__init__.py").write_text(
        "import sys\n"
        "import torch\n"
        f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "from fake_torch_npu import FakeNpu\n"
        "npu = FakeNpu()\n"
        'torch.utils.rename_privateuse1_backend("npu")\n'
        'torch._register_device_module("npu", npu)\n'
    )


# --- operators ------------------------------------------------------------------------------------------------
# torch_npu's kernels, computed with plain torch on CPU tensors. The ATB ones are registered as real torch operators
# (namespace "atb", the schemas of Ascend/op-plugin:op_plugin/ops/atb/*.cpp) so that a graph records each as one
# operator, as NPUGraph's auto-dispatch capture does; the aclnn ones (norms, swiglu, rotary) are plain functions.


class AtbCheckError(RuntimeError):
    """What torch_npu / ATB raise on arguments a kernel cannot take."""


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise AtbCheckError(message)


HALF = (torch.bfloat16, torch.float16)
FLOATS = (*HALF, torch.float32)


def _check_cache(name: str, cache: torch.Tensor, dtype: torch.dtype) -> tuple[int, int, int, int]:
    # ATB reads the caches by their base pointer (ParamSetter.Input without the contiguous flag): strides must be
    # the packed [blocks, block_size, kv_heads, head_dim] ones.
    _require(
        cache.dim() == 4, f"{name} must be [num_blocks, block_size, num_kv_heads, head_size], got {tuple(cache.shape)}"
    )
    _require(cache.is_contiguous(), f"{name} must be contiguous (ATB reads it by its base pointer)")
    _require(cache.dtype == dtype, f"{name} is {cache.dtype}, the query/key {dtype}")
    return tuple(cache.shape)


def _check_int32(name: str, t: torch.Tensor, dim: int) -> None:
    _require(t.dtype == torch.int32, f"{name} must be int32, got {t.dtype}")
    _require(t.dim() == dim, f"{name} must be {dim}-D, got {tuple(t.shape)}")


def _reshape_and_cache(key, value, key_cache, value_cache, slot_indices):
    _require(key.dtype in HALF, f"_npu_reshape_and_cache: key must be float16/bfloat16, got {key.dtype}")
    blocks, block_size, heads, dim = _check_cache("key_cache", key_cache, key.dtype)
    _check_cache("value_cache", value_cache, key.dtype)
    _require(value_cache.shape == key_cache.shape, "key_cache and value_cache differ in shape")
    _require(key.shape == value.shape and key.dim() == 3, f"key/value must be [T, H, D], got {tuple(key.shape)}")
    _require(tuple(key.shape[1:]) == (heads, dim), f"key [T, {heads}, {dim}] expected, got {tuple(key.shape)}")
    _check_int32("slot_indices", slot_indices, 1)
    _require(slot_indices.shape[0] == key.shape[0], "one slot per token")
    slots = slot_indices.long()
    _require(bool(((slots >= 0) & (slots < blocks * block_size)).all()), "slot_indices out of the cache")
    key_cache.view(-1, heads, dim)[slots] = key
    value_cache.view(-1, heads, dim)[slots] = value


def _paged_keys(cache, block_table, b, length, block_size):
    j = torch.arange(length)
    pages = block_table[b, j // block_size].long()
    return cache[pages, j % block_size]  # [length, kv_heads, head_dim]


def _attend(q, keys, values, scale, allowed):
    """q [n, Hq, D], keys/values [L, Hkv, D], allowed [n, L] bool -> [n, Hq, D] (fp32 softmax)."""
    group = q.shape[1] // keys.shape[1]
    k = keys.float().repeat_interleave(group, dim=1)
    v = values.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q.float(), k) * scale
    scores = scores.masked_fill(~allowed[None], float("-inf"))
    return torch.einsum("hnl,lhd->nhd", scores.softmax(-1), v)


def _check_block_table(block_table, batch, lens, block_size, blocks):
    _check_int32("block_table", block_table, 2)
    _require(block_table.shape[0] >= batch, f"block_table has {block_table.shape[0]} rows for {batch} sequences")
    need = int(((lens + block_size - 1) // block_size).max()) if lens.numel() else 0
    _require(block_table.shape[1] >= need, f"block_table holds {block_table.shape[1]} blocks, a sequence needs {need}")
    used = torch.cat([block_table[b, : (int(n) + block_size - 1) // block_size] for b, n in enumerate(lens)])
    _require(bool(((used >= 0) & (used < blocks)).all()), "block_table names a block outside the cache")


def _paged_attention(
    query, key_cache, value_cache, num_kv_heads, num_heads, scale_value, block_table, context_lens, out, workspace=None
):
    _require(query.dtype in HALF, f"_npu_paged_attention: query must be float16/bfloat16, got {query.dtype}")
    _require(query.dim() == 3, f"query must be [B, Hq, D], got {tuple(query.shape)}")
    batch, heads, dim = query.shape
    blocks, block_size, kv_heads, cache_dim = _check_cache("key_cache", key_cache, query.dtype)
    _check_cache("value_cache", value_cache, query.dtype)
    _require((heads, kv_heads, dim) == (num_heads, num_kv_heads, cache_dim), "heads or head_size disagree")
    _require(heads % kv_heads == 0, "query heads must group over the KV heads")
    _check_int32("context_lens", context_lens, 1)
    _require(context_lens.shape[0] == batch, "one context length per sequence")
    _check_block_table(block_table, batch, context_lens, block_size, blocks)
    _require(out.shape == query.shape and out.dtype == query.dtype and out.is_contiguous(), "out must be like query")
    # All sequences at once: key j of sequence b is in block block_table[b, j // block_size].
    lens = context_lens.long()
    length = max(int(lens.max()), 1)
    j = torch.arange(length)
    pages = block_table[:batch, (j // block_size).clamp(max=block_table.shape[1] - 1)].long()  # [B, L]
    keys, values = key_cache[pages, j % block_size], value_cache[pages, j % block_size]  # [B, L, Hkv, D]
    group = heads // kv_heads
    q = query.float().view(batch, kv_heads, group, dim)
    scores = torch.einsum("bhgd,blhd->bhgl", q, keys.float()) * scale_value
    valid = j[None, :] < lens[:, None]
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    o = torch.einsum("bhgl,blhd->bhgd", scores.softmax(-1).nan_to_num(0.0), values.float())
    out.copy_(o.reshape(batch, heads, dim))


def _flash_attention_qlens(
    query, key_cache, value_cache, block_table, mask, seq_len, context_lens, num_kv_heads, num_heads, scale_value, out
):
    _require(query.dtype in HALF, f"_npu_flash_attention_qlens: query must be float16/bfloat16, got {query.dtype}")
    blocks, block_size, kv_heads, dim = _check_cache("key_cache", key_cache, query.dtype)
    _check_cache("value_cache", value_cache, query.dtype)
    _require((kv_heads, num_kv_heads * 0 + kv_heads) == (num_kv_heads, kv_heads), "num_kv_heads disagrees")
    tokens = query.shape[0]
    _require(query.numel() == tokens * num_heads * dim, "query must be [T, Hq*D] or [T, Hq, D]")
    _require(out.shape == query.shape and out.dtype == query.dtype, "out must be like query")
    _require(mask.shape == (128, 128) and mask.dtype == query.dtype, "mask: the compressed 128 x 128 one, query dtype")
    _check_int32("seq_len", seq_len, 1)
    _check_int32("context_lens", context_lens, 1)
    _require(seq_len.shape == context_lens.shape, "seq_len and context_lens: one per sequence")
    _require(int(seq_len.sum()) == tokens, f"seq_len sums to {int(seq_len.sum())}, the query holds {tokens} tokens")
    _require(bool((seq_len <= context_lens).all()), "a sequence's new tokens exceed its context")
    _check_block_table(block_table, seq_len.shape[0], context_lens, block_size, blocks)
    q = query.view(tokens, num_heads, dim)
    o = out.view(tokens, num_heads, dim)
    start = 0
    for b in range(seq_len.shape[0]):
        n, total = int(seq_len[b]), int(context_lens[b])
        keys = _paged_keys(key_cache, block_table, b, total, block_size)
        values = _paged_keys(value_cache, block_table, b, total, block_size)
        # Causal from the bottom right: new token i sees the cached prefix and new tokens 0..i.
        allowed = torch.arange(total)[None, :] <= (total - n + torch.arange(n))[:, None]
        o[start : start + n] = _attend(q[start : start + n], keys, values, scale_value, allowed)
        start += n


_ATB_SCHEMAS = {
    "_npu_reshape_and_cache": (
        "_npu_reshape_and_cache(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
        "Tensor slot_indices) -> ()",
        _reshape_and_cache,
    ),
    "_npu_paged_attention": (
        "_npu_paged_attention(Tensor query, Tensor key_cache, Tensor value_cache, int num_kv_heads, int num_heads, "
        "float scale_value, Tensor block_table, Tensor context_lens, Tensor(a!) out, *,Tensor? workspace=None) -> ()",
        _paged_attention,
    ),
    "_npu_flash_attention_qlens": (
        "_npu_flash_attention_qlens(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_table, "
        "Tensor mask, Tensor seq_len, Tensor context_lens, int num_kv_heads, int num_heads, float scale_value, "
        "Tensor(a!) out) -> ()",
        _flash_attention_qlens,
    ),
}
# The host arguments each ATB operator reads when launched (argument index), and the update() key that rewrites
# it (Ascend/pytorch:torch_npu/npu/_npugraph_handlers/simple_handler.py).
HOST_ARGS = {"_npu_paged_attention.default": {7: "context_lens"}}
_LIBRARY = None


def _register_atb_ops() -> None:
    """Once per process (a library cannot define an operator twice): torch.ops.atb.<name> with the real schemas."""
    global _LIBRARY
    if hasattr(torch.ops.atb, "_npu_paged_attention"):
        return
    _LIBRARY = torch.library.Library("atb", "DEF")
    for name, (schema, impl) in _ATB_SCHEMAS.items():
        _LIBRARY.define(schema)
        _LIBRARY.impl(name, impl, "CPU")
    torch._fake_torch_npu_atb_library = _LIBRARY  # kept alive with torch, whichever copy of this file made it


def npu_rms_norm(self, gamma, epsilon=1e-6):
    pairs = {
        (torch.float16, torch.float32),
        (torch.bfloat16, torch.float32),
        (torch.float16, torch.float16),
        (torch.bfloat16, torch.bfloat16),
        (torch.float32, torch.float32),
    }
    _require((self.dtype, gamma.dtype) in pairs, f"npu_rms_norm: no kernel for ({self.dtype}, {gamma.dtype})")
    _require(2 <= self.dim() <= 8, f"npu_rms_norm: self must have 2-8 dims, got {self.dim()}")
    n = gamma.dim()
    _require(tuple(gamma.shape) == tuple(self.shape[-n:]), "npu_rms_norm: gamma must be self's trailing shape")
    dims = tuple(range(-n, 0))
    x = self.float()
    rstd = torch.rsqrt(x.pow(2).mean(dims, keepdim=True) + epsilon)
    return (x * rstd * gamma.float()).to(self.dtype), rstd


def npu_add_rms_norm(x1, x2, gamma, epsilon=1e-6):
    _require(x1.dtype in FLOATS and x2.dtype == x1.dtype and gamma.dtype == x1.dtype, "npu_add_rms_norm: one dtype")
    _require(x1.shape == x2.shape, "npu_add_rms_norm: x1 and x2 differ in shape")
    summed = x1.float() + x2.float()
    y, rstd = npu_rms_norm(summed, gamma.float(), epsilon)
    return y.to(x1.dtype), rstd, summed.to(x1.dtype)


def npu_swiglu(input, dim=-1):  # noqa: A002 (torch_npu's name)
    _require(input.dtype in FLOATS, f"npu_swiglu: no kernel for {input.dtype}")
    _require(input.is_contiguous(), "npu_swiglu: the input must be contiguous")
    _require(input.shape[dim] % 2 == 0, "npu_swiglu: the split dimension must be even")
    a, b = input.float().chunk(2, dim=dim)
    return (torch.nn.functional.silu(a) * b).to(input.dtype)


def npu_rotary_mul(input, r1, r2, rotary_mode="half", rotate=None):  # noqa: A002
    _require(rotary_mode == "half" and rotate is None, "not faked: interleave mode, rotate matrix")
    _require(input.dim() in (3, 4), f"npu_rotary_mul: input must be 3-D or 4-D, got {input.dim()}")
    _require(r1.dtype == input.dtype == r2.dtype, "npu_rotary_mul: input, r1, r2 in one dtype")
    _require(r1.shape == r2.shape and r1.dim() == input.dim(), "npu_rotary_mul: r1/r2 shaped like input")
    d = input.shape[-1]
    _require(d % 2 == 0 and d < 896, f"npu_rotary_mul: D must be even and below 896, got {d}")
    # Half mode broadcasts r1/r2 over heads only (layouts 1S1D, BS1D, BSND for BSND input; T1D, TND for TND).
    _require(r1.shape[-1] == d and r1.shape[-2] in (1, input.shape[-2]), "npu_rotary_mul: r1 layout")
    _require(r1.shape[-3] == input.shape[-3], "npu_rotary_mul: r1 must hold every position of input")
    x = input.float()
    first, second = x.chunk(2, dim=-1)
    rotated = torch.cat((-second, first), dim=-1)
    return (x * r1.float() + rotated * r2.float()).to(input.dtype)


# --- weight-only quantized matmul, as Atlas A2/A3 run it (Ascend/op-plugin docs/zh/custom_APIs/torch_npu/
# torch_npu-npu_convert_weight_to_int4pack.md, -npu_weight_quant_batchmatmul.md) ---

WQBMM_DIM_LIMIT = 65535  # K and N within [1, 65535]
_NIBBLE_SHIFTS = torch.arange(0, 32, 4)


def npu_convert_weight_to_int4pack(weight, inner_k_tiles=0):
    """int32 [d0, d1] of values in [-8, 7] -> int32 [d0, d1 / 8]: value 8c + i in bits 4i..4i+3 of word c, as
    two's complement nibbles (pack_int4_3dim, the CPU golden of Ascend/op-plugin
    test/test_custom_ops/test_npu_convert_weight_to_int4pack.py)."""
    _require(weight.dtype == torch.int32 and weight.dim() == 2, "npu_convert_weight_to_int4pack: int32 2-D weight")
    _require(weight.is_contiguous(), "npu_convert_weight_to_int4pack: no non-contiguous weight")
    _require(weight.shape[1] % 8 == 0, f"npu_convert_weight_to_int4pack: last dim 8-aligned, got {weight.shape[1]}")
    _require(bool(((weight >= -8) & (weight <= 7)).all()), "npu_convert_weight_to_int4pack: values in [-8, 7]")
    nibbles = (weight.long() & 0xF).view(weight.shape[0], -1, 8)
    words = (nibbles << _NIBBLE_SHIFTS).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _unpack_int4(words):
    """int32 [r, c] -> int32 [r, 8c]: each word's eight signed nibbles, the lowest bits first."""
    nibbles = (words.unsqueeze(-1) >> _NIBBLE_SHIFTS.to(torch.int32)) & 0xF
    return (nibbles - ((nibbles & 8) << 1)).reshape(words.shape[0], -1)


def _per_row(t, k, group_size):
    """An antiquant scale/offset as [K or 1, N or 1]: per tensor (1,)/(1, 1), per channel (N,)/(1, N), per group
    (ceil(K / group_size), N), row k reading group k // group_size."""
    t = t.reshape(1, -1) if t.dim() == 1 else t
    return t[torch.arange(k) // group_size] if group_size else t


def npu_weight_quant_batchmatmul(
    x,
    weight,
    antiquant_scale,
    antiquant_offset=None,
    quant_scale=None,
    quant_offset=None,
    bias=None,
    antiquant_group_size=0,
    inner_precise=0,
):
    """y = x @ ((weight + antiquant_offset) * antiquant_scale) + bias for an int4pack weight: the weight antiquantized
    in x's dtype, the product accumulated in float32 (supported_op_exec, the test's golden)."""
    _require(quant_scale is None and quant_offset is None, "not faked: output quantization (quant_scale)")
    _require(x.dim() == 2 and x.dtype in HALF, f"npu_weight_quant_batchmatmul: x 2-D float16/bfloat16, got {x.dtype}")
    _require(x.is_contiguous() or x.t().is_contiguous(), "npu_weight_quant_batchmatmul: x contiguous or transposed")
    _require(weight.dim() == 2 and weight.dtype == torch.int32, "not faked: int8 weights (int32 int4pack expected)")
    # int32 carries eight values along its storage's last dimension, K's when transposed
    # (op-plugin op_plugin/ops/opapi/WeightQuantBatchMatmulV2KernelNpuOpApi.cpp).
    transposed = not weight.is_contiguous()
    _require(not transposed or weight.t().is_contiguous(), "weight: contiguous, or a contiguous one transposed")
    w = _unpack_int4(weight.t()).t() if transposed else _unpack_int4(weight)  # [K, N]
    k, n = w.shape
    _require(x.shape[0] >= 1, "npu_weight_quant_batchmatmul: no empty tensor")
    _require(x.shape[1] == k, f"npu_weight_quant_batchmatmul: x's K {x.shape[1]}, weight's {k}")
    _require(k <= WQBMM_DIM_LIMIT and n <= WQBMM_DIM_LIMIT, f"K, N within [1, 65535], got {k}, {n}")
    _require(inner_precise in (0, 1), f"inner_precise 0 or 1, got {inner_precise}")
    g = antiquant_group_size
    _require(g == 0 or (32 <= g <= k - 1 and g % 32 == 0), f"antiquant_group_size 0 or 32j in [32, K - 1], got {g}")
    shapes = {(-(-k // g), n)} if g else {(1,), (1, 1), (n,), (1, n)}
    _require(tuple(antiquant_scale.shape) in shapes, f"antiquant_scale {tuple(antiquant_scale.shape)}, not {shapes}")
    _require(antiquant_scale.dtype == x.dtype, "npu_weight_quant_batchmatmul: antiquant_scale in x's dtype")
    if antiquant_offset is not None:
        _require(antiquant_offset.shape == antiquant_scale.shape, "antiquant_offset: antiquant_scale's shape")
        _require(antiquant_offset.dtype == antiquant_scale.dtype, "antiquant_offset: antiquant_scale's dtype")
    if bias is not None:
        _require(tuple(bias.shape) in {(n,), (1, n)} and bias.is_contiguous(), "bias: contiguous (N,) or (1, N)")
        wanted = torch.float32 if x.dtype == torch.bfloat16 else torch.float16
        _require(bias.dtype == wanted, f"npu_weight_quant_batchmatmul: bias {wanted} for {x.dtype} x, got {bias.dtype}")
    antiquantized = w.to(x.dtype)
    if antiquant_offset is not None:
        antiquantized = antiquantized + _per_row(antiquant_offset, k, g)
    antiquantized = antiquantized * _per_row(antiquant_scale, k, g)
    y = x.float() @ antiquantized.float()
    if bias is not None:
        y = y + bias.float().reshape(-1)
    return y.to(x.dtype)


# --- graphs (torch_npu/npu/graphs.py) ---


class FakeNPUGraph(RecordingGraph):
    """NPUGraph over the recording graph: ATB host arguments are frozen at capture, `update` rewrites them."""

    def __init__(self):
        super().__init__()
        self.auto_dispatch_capture = False
        self.updates = 0

    def _host_records(self):
        return [i for i, op in enumerate(self.ops) if op[0].__name__ in HOST_ARGS]

    def _set_args(self, i, new_values):
        func, spec, flat, out = self.ops[i]
        args, kwargs = tree_unflatten(flat, spec)
        args = list(args)
        for index, value in new_values.items():
            args[index] = value.clone()  # read on the host when the task is (re)issued
        flat, spec = tree_flatten((tuple(args), kwargs))
        self.ops[i] = (func, spec, flat, out)

    def capture_end(self):
        super().capture_end()
        for i in self._host_records():
            args, _ = tree_unflatten(self.ops[i][2], self.ops[i][1])
            self._set_args(i, {index: args[index] for index in HOST_ARGS[self.ops[i][0].__name__]})

    def update(self, cpu_update_input):
        if not self.auto_dispatch_capture:
            raise RuntimeError(
                "The current graph configuration does not support update, Try to capture by setting "
                "auto_dispatch_capture=True during capture"
            )
        records = self._host_records()
        if len(cpu_update_input) == 1:
            cpu_update_input = [dict(cpu_update_input[0]) for _ in records]
        if len(cpu_update_input) != len(records):
            raise RuntimeError(f"{len(records)} operators to update, {len(cpu_update_input)} inputs")
        for i, update in zip(records, cpu_update_input, strict=True):
            func, spec, flat, _ = self.ops[i]
            args, _ = tree_unflatten(flat, spec)
            new = {}
            for index, key in HOST_ARGS[func.__name__].items():
                if key in update:
                    _require(update[key].shape == args[index].shape, f"update of {key}: the captured shape")
                    new[index] = update[key]
            self._set_args(i, new)
        self.updates += 1


class fake_graph:  # noqa: N801 (torch.npu.graph)
    def __init__(self, npu_graph, pool=None, stream=None, auto_dispatch_capture=False, capture_error_mode="global"):
        self.graph, self.pool, self.mode = npu_graph, pool, capture_error_mode
        npu_graph.auto_dispatch_capture = auto_dispatch_capture

    def __enter__(self):
        self.graph.capture_begin(pool=self.pool, capture_error_mode=self.mode)

    def __exit__(self, *exc):
        self.graph.capture_end()


def npu_top_k_top_p(logits, p, k):
    """aclnnApplyTopKTopP as the CANN doc computes it (aolapi/context/aclnnApplyTopKTopP.md): an ascending stable
    sort; -inf below the k-th largest value; softmax; the ascending cumulative sum; -inf where it is at most 1 - p,
    never at the largest position; back in the input's order."""
    _require(logits.dim() == 2 and logits.dtype in FLOATS, "npu_top_k_top_p: 2-D float32/float16/bfloat16 logits")
    _require(p.dtype == logits.dtype and p.shape == logits.shape[:1], "npu_top_k_top_p: p [B] in the logits' dtype")
    _require(k.dtype == torch.int32 and k.shape == logits.shape[:1], "npu_top_k_top_p: k [B] int32")
    _require(bool(((k >= 1) & (k <= 1024)).all()), "npu_top_k_top_p: k must lie in [1, 1024]")
    vocab = logits.shape[1]
    values, indices = logits.float().sort(dim=-1, descending=False, stable=True)
    kth = values.gather(-1, (vocab - k.long()).unsqueeze(-1))
    values = values.masked_fill(values < kth, float("-inf"))
    cumulative = values.softmax(dim=-1).cumsum(dim=-1)
    drop = cumulative <= 1 - p.float().unsqueeze(-1)
    drop[:, -1] = False
    values = values.masked_fill(drop, float("-inf"))
    return torch.empty_like(values).scatter_(-1, indices, values).to(logits.dtype)


# --- MoE (aclnn kernels): torch operators of namespace "npu", as torch_npu registers them (torch.ops.npu.*), with
# the schemas' argument names (Ascend/torchair ge_converter docstrings "NB: npu::..."), so that a graph records each
# as one operator and its checks may read values on the host, as the kernel does on the device. Each computes what
# its doc gives (Ascend/op-plugin docs/zh/custom_APIs/torch_npu/torch_npu-npu_moe_*.md, -npu_grouped_matmul.md).

ROUTING_SIZE_LIMIT = 1 << 24  # npu_moe_init_routing's x, npu_moe_compute_expert_tokens' ids: below 2^24 elements
GMM_INNER_LIMIT = 65536  # npu_grouped_matmul on Atlas A2/A3: every last dimension below InnerLimit
GMM_MAX_GROUPS = 1024  # npu_grouped_matmul, single tensors grouped on M: group_list of at most 1024 groups


def _moe_gating_top_k_softmax(x, finished=None, k=1):
    """softmaxOut = softmax(x, -1); yOut, expertIdxOut = topK(softmaxOut, k); rowIdxOut[i, j] = j * rows + i."""
    _require(x.dim() in (2, 3) and x.dtype in FLOATS, "npu_moe_gating_top_k_softmax: x 2-D/3-D float16/bf16/float32")
    _require(finished is None, "not faked: finished")
    _require(0 < k <= min(x.shape[-1], 1024), f"npu_moe_gating_top_k_softmax: k in (0, min(E, 1024)], got {k}")
    y, expert_idx = torch.topk(torch.softmax(x.float(), dim=-1), k, dim=-1)
    rows = expert_idx.numel() // k
    row_idx = torch.arange(rows * k, dtype=torch.int32).view(k, rows).t().reshape(expert_idx.shape)
    return y.to(x.dtype), expert_idx.to(torch.int32), row_idx


def _moe_init_routing(x, row_idx, expert_idx, active_num):
    """The doc's cpu_op_exec: a stable sort of the flattened expert ids; expanded_row_idx[dst_to_src] = arange;
    expanded_x = x[dst_to_src[: min(active_num, rows) * k] % rows]."""
    _require(x.dim() == 2 and x.dtype in FLOATS, "npu_moe_init_routing: x must be 2-D float16/bfloat16/float32")
    _require(x.numel() < ROUTING_SIZE_LIMIT, f"npu_moe_init_routing: x's size must be below 2^24, got {x.numel()}")
    _check_int32("row_idx", row_idx, 2)
    _check_int32("expert_idx", expert_idx, 2)
    _require(row_idx.shape == expert_idx.shape, "npu_moe_init_routing: row_idx must be shaped like expert_idx")
    _require(expert_idx.shape[0] == x.shape[0], "npu_moe_init_routing: expert_idx must be [NUM_ROWS, K]")
    _require(active_num >= 0, f"npu_moe_init_routing: active_num must not be negative, got {active_num}")
    rows, k = expert_idx.shape
    dst_to_src = row_idx.reshape(-1).long()
    _require(torch.equal(dst_to_src.sort().values, torch.arange(rows * k)), "row_idx must number each slot once")
    expanded_expert_idx, order = expert_idx.reshape(-1).sort(stable=True)
    dst_to_src = dst_to_src[order]
    expanded_row_idx = torch.empty(rows * k, dtype=torch.int32)
    expanded_row_idx[dst_to_src] = torch.arange(rows * k, dtype=torch.int32)
    expanded_x = x[dst_to_src[: min(active_num, rows) * k] % max(rows, 1)]
    return expanded_x, expanded_row_idx, expanded_expert_idx


def _moe_compute_expert_tokens(sorted_expert_for_source_row, num_expert):
    """out[i] = BinarySearch(sortedExperts, i): the index just past expert i's last row (the aclnn doc's golden,
    hicann/ops-transformer moe/moe_compute_expert_tokens/tests/ut/op_kernel/moe_expert_data/gen_data.py)."""
    ids = sorted_expert_for_source_row
    _check_int32("sorted_expert_for_source_row", ids, 1)
    _require(ids.numel() < ROUTING_SIZE_LIMIT, "npu_moe_compute_expert_tokens: fewer than 2^24 ids")
    _require(0 < num_expert <= 2048, f"npu_moe_compute_expert_tokens: num_expert in (0, 2048], got {num_expert}")
    _require(bool(((ids >= 0) & (ids < num_expert)).all()), "npu_moe_compute_expert_tokens: ids in [0, num_expert)")
    _require(bool((ids[1:] >= ids[:-1]).all()), "npu_moe_compute_expert_tokens: the ids must be sorted")
    return torch.searchsorted(ids, torch.arange(num_expert, dtype=torch.int32), right=True, out_int32=True)


def _grouped_matmul(
    x,
    weight,
    *,
    bias=None,
    antiquant_scale=None,
    antiquant_offset=None,
    group_list=None,
    split_item=0,
    group_type=-1,
    group_list_type=0,
    output_dtype=None,
):
    """x/weight/y single tensors grouped on M (group_type 0): y[rows of g] = x[rows of g] @ w[g]. Non-quantised, or
    antiquant (formula 4) for an int4 weight carried as int32 [E, K, N / 8]: w[g] = (w[g] + antiquant_offset[g]) *
    antiquant_scale[g] in x's dtype, per group [E, G, N] (G dividing K) or per channel [E, N], the product in float32
    (as npu_weight_quant_batchmatmul's golden)."""
    _require(len(x) == 1 and len(weight) == 1, "not faked: several x or weight tensors")
    _require(bias is None, "not faked: bias")
    _require(group_type == 0 and split_item in (2, 3), "single x, weight and y: group_type 0, split_item 2 or 3")
    x, w = x[0], weight[0]
    _require(x.dim() == 2 and w.dim() == 3, "npu_grouped_matmul: x [M, K] 2-D, weight [E, K, N] 3-D")
    _require(x.is_contiguous(), "npu_grouped_matmul: x must not be transposed")
    if w.dtype == torch.int32:
        w = _antiquantized(x, w, antiquant_scale, antiquant_offset, output_dtype)
    else:
        _require(antiquant_scale is None and antiquant_offset is None, "antiquant: int8/int4 weights only")
        _require(x.dtype in FLOATS and w.dtype == x.dtype, "npu_grouped_matmul: x and weight in one float dtype")
        _require(output_dtype in (None, x.dtype), "npu_grouped_matmul: a non-quantised y is in x's dtype")
    transposed = not w.is_contiguous()
    _require(not transposed or w.transpose(1, 2).is_contiguous(), "weight: contiguous, or a contiguous one transposed")
    _require(x.shape[1] == w.shape[1], f"npu_grouped_matmul: x's K {x.shape[1]}, weight's {w.shape[1]}")
    last = w.shape[1] if transposed else w.shape[2]
    _require(x.shape[1] < GMM_INNER_LIMIT and last < GMM_INNER_LIMIT, "npu_grouped_matmul: last dims below 65536")
    _require(group_list is not None and group_list.dtype == torch.int64, "npu_grouped_matmul: group_list int64 Tensor")
    _require(group_list.dim() == 1 and group_list.shape[0] == w.shape[0], "group_list: one entry per weight group")
    _require(group_list.shape[0] <= GMM_MAX_GROUPS, "npu_grouped_matmul: at most 1024 groups")
    _require(group_list_type in (0, 1), "npu_grouped_matmul: group_list_type 2 only for int8")
    counts = group_list if group_list_type == 1 else torch.diff(group_list, prepend=group_list.new_zeros(1))
    _require(bool((counts >= 0).all()), "group_list: non-negative sizes (type 0: a non-decreasing cumsum)")
    _require(int(counts.sum()) == x.shape[0], f"group_list must cover x's {x.shape[0]} rows (type 0: last value M)")
    y = torch.empty(x.shape[0], w.shape[2], dtype=x.dtype)
    start = 0
    for group, size in enumerate(counts.tolist()):
        y[start : start + size] = (x[start : start + size].float() @ w[group].float()).to(x.dtype)
        start += size
    return [y]


def _antiquantized(x, words, scale, offset, output_dtype):
    """The int4 weight [E, K, N] antiquantized in x's dtype (the grouped matmul's formula 4 and table 2)."""
    _require(x.dtype in HALF, f"npu_grouped_matmul antiquant: x float16/bfloat16, got {x.dtype}")
    _require(output_dtype in (None, x.dtype), "npu_grouped_matmul antiquant: y in x's dtype")
    _require(words.is_contiguous(), "not faked: a transposed int4 weight")
    experts, k, _ = words.shape
    w = _unpack_int4(words.reshape(experts * k, -1)).view(experts, k, -1)  # [E, K, N]
    n = w.shape[2]
    _require(n % 2 == 0, "npu_grouped_matmul: an int4 weight's last dimension even")
    _require(scale is not None and len(scale) == 1, "npu_grouped_matmul antiquant: one antiquant_scale tensor")
    scale = scale[0]
    _require(scale.dtype == x.dtype, "npu_grouped_matmul: antiquant_scale in x's dtype")
    per_group = scale.dim() == 3
    wanted = (experts, scale.shape[1], n) if per_group else (experts, n)
    _require(scale.shape == wanted, f"antiquant_scale [E, G, N] or [E, N], got {tuple(scale.shape)}")
    groups = scale.shape[1] if per_group else 1
    _require(k % groups == 0, f"npu_grouped_matmul: pergroup G must divide K, got G {groups}, K {k}")
    expand = (lambda t: t.repeat_interleave(k // groups, dim=1)) if per_group else (lambda t: t[:, None, :])
    antiquantized = w.to(x.dtype)
    if offset is not None:
        _require(len(offset) == 1, "npu_grouped_matmul antiquant: one antiquant_offset tensor")
        offset = offset[0]
        _require(offset.shape == scale.shape and offset.dtype == scale.dtype, "antiquant_offset: antiquant_scale's")
        antiquantized = antiquantized + expand(offset)
    return antiquantized * expand(scale)


def _moe_finalize_routing(
    expanded_permuted_rows, skip1, skip2, bias, scales, expanded_src_to_dst_row, export_for_source_row, drop_pad_mode=0
):
    """out[i] = skip1[i] + skip2[i] + sum_k scales[i, k] * (rows[src_to_dst[k * NUM_ROWS + i]] + bias[expert[i, k]])
    (drop-less mode, drop_pad_mode 0)."""
    rows, src_to_dst, experts = expanded_permuted_rows, expanded_src_to_dst_row, export_for_source_row
    _require(drop_pad_mode == 0, "not faked: the drop-pad modes and the row-wise layout (drop_pad_mode 1-3)")
    _require(rows.dim() == 2 and rows.dtype in FLOATS, "npu_moe_finalize_routing: rows 2-D float16/bfloat16/float32")
    _require(scales is not None, "not faked: scales None")
    _require(scales.dim() == 2 and scales.dtype == rows.dtype, "npu_moe_finalize_routing: scales [N, K] in rows' dtype")
    num_rows, k = scales.shape
    hidden = rows.shape[1]
    _require(rows.shape[0] == num_rows * k, "npu_moe_finalize_routing: expanded_permuted_rows must be [N * K, H]")
    _check_int32("expanded_src_to_dst_row", src_to_dst, 1)
    _require(src_to_dst.shape[0] == num_rows * k, "expanded_src_to_dst_row: one entry per slot")
    _require(bool(((src_to_dst >= 0) & (src_to_dst < num_rows * k)).all()), "expanded_src_to_dst_row: [0, N * K)")
    _require(skip2 is None or skip1 is not None, "npu_moe_finalize_routing: skip2 only with skip1")
    for skip in (skip1, skip2):
        _require(skip is None or (skip.shape == (num_rows, hidden) and skip.dtype == rows.dtype), "skip: [N, H]")
    if experts is not None:
        _check_int32("export_for_source_row", experts, 2)
        _require(experts.shape == scales.shape, "export_for_source_row: [N, K]")
    gathered = rows.float()[src_to_dst.long().view(k, num_rows)]  # [K, N, H]: slot (i, j) at j * N + i
    if bias is not None:
        _require(experts is not None, "npu_moe_finalize_routing: bias needs export_for_source_row")
        _require(bias.dim() == 2 and bias.shape[1] == hidden and bias.dtype == rows.dtype, "bias: [E, H]")
        _require(bool(((experts >= 0) & (experts < bias.shape[0])).all()), "export_for_source_row: [0, E)")
        gathered = gathered + bias.float()[experts.long().t()]
    out = (scales.float().t()[..., None] * gathered).sum(0)
    for skip in (skip1, skip2):
        if skip is not None:
            out = out + skip.float()
    return out.to(rows.dtype)


_NPU_SCHEMAS = {
    "npu_moe_gating_top_k_softmax": (
        "npu_moe_gating_top_k_softmax(Tensor x, Tensor? finished=None, int k=1) -> (Tensor, Tensor, Tensor)",
        _moe_gating_top_k_softmax,
    ),
    "npu_moe_init_routing": (
        "npu_moe_init_routing(Tensor x, Tensor row_idx, Tensor expert_idx, int active_num) -> (Tensor, Tensor, Tensor)",
        _moe_init_routing,
    ),
    "npu_moe_compute_expert_tokens": (
        "npu_moe_compute_expert_tokens(Tensor sorted_expert_for_source_row, int num_expert) -> Tensor",
        _moe_compute_expert_tokens,
    ),
    "npu_grouped_matmul": (
        "npu_grouped_matmul(Tensor[] x, Tensor[] weight, *, Tensor[]? bias=None, Tensor[]? antiquant_scale=None, "
        "Tensor[]? antiquant_offset=None, Tensor? group_list=None, int? split_item=0, int? group_type=-1, "
        "int? group_list_type=0, ScalarType? output_dtype=None) -> Tensor[]",
        _grouped_matmul,
    ),
    "npu_moe_finalize_routing": (
        "npu_moe_finalize_routing(Tensor expanded_permuted_rows, Tensor? skip1, Tensor? skip2, Tensor? bias, "
        "Tensor? scales, Tensor expanded_src_to_dst_row, Tensor? export_for_source_row, int? drop_pad_mode=0) "
        "-> Tensor",
        _moe_finalize_routing,
    ),
}


def _register_npu_ops() -> None:
    """Once per process, as _register_atb_ops: torch.ops.npu.<name> for the MoE kernels."""
    if hasattr(torch.ops.npu, "npu_moe_init_routing"):
        return
    library = torch.library.Library("npu", "DEF")
    for name, (schema, impl) in _NPU_SCHEMAS.items():
        library.define(schema)
        library.impl(name, impl, "CPU")
    torch._fake_torch_npu_npu_library = library


def make_fake_torch_npu(npu: FakeNpu | None = None, *, atb: bool = True, graphs: bool = True) -> types.ModuleType:
    """A torch_npu with its operators (atb=False: NNAL missing, no torch.ops.atb) and NPU graphs."""
    npu = npu or FakeNpu()
    module = make_torch_npu(npu)
    if graphs:
        npu.NPUGraph, npu.graph, npu.graph_pool_handle = FakeNPUGraph, fake_graph, new_pool
    if atb:
        _register_atb_ops()
        for name in _ATB_SCHEMAS:
            setattr(module, name, getattr(torch.ops.atb, name))
    quant = (npu_convert_weight_to_int4pack, npu_weight_quant_batchmatmul)
    for fn in (npu_rms_norm, npu_add_rms_norm, npu_swiglu, npu_rotary_mul, npu_top_k_top_p, *quant):
        setattr(module, fn.__name__, fn)
    _register_npu_ops()
    for name in _NPU_SCHEMAS:
        setattr(module, name, getattr(torch.ops.npu, name))
    return module
