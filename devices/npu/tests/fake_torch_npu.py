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
    for fn in (npu_rms_norm, npu_add_rms_norm, npu_swiglu, npu_rotary_mul, npu_top_k_top_p):
        setattr(module, fn.__name__, fn)
    return module
