"""The platform contract every device must meet: `pytest --pyargs omnirun.conformance --device <name>`.

A vendor bringing up a device (in-tree or as a plugin) runs this suite on its hardware; each CI lane runs it on
its own device. The `platform` fixture fails, rather than skips, when the lane's device is unavailable.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from omnirun.distributed import init_distributed, plan_world
from omnirun.facts import Capabilities
from omnirun.layers import native_ops
from omnirun.layers.ops import OP_NAMES, Ops, resolve_ops
from omnirun.registry import default_registry
from omnirun.sampling import SamplingBatch, SamplingParams

MIB = 1 << 20


def test_probe_is_available_and_stable(platform):
    first, second = platform.probe(), platform.probe()
    assert first.available and first.reason == ""
    assert first == second
    assert first.device_count >= 1 and platform.device_count() == first.device_count


def test_probe_does_not_initialise_the_device(platform, device_name):
    # A fresh process, since this one may have initialised the device already.
    code = (
        "from omnirun.registry import get_platform\n"
        f"platform = get_platform({device_name!r})\n"
        "module = platform.device_module\n"
        "before = module.is_initialized()\n"
        "platform.probe()\n"
        "print(before, module.is_initialized())\n"
    )
    before, after = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.split()
    if before == "True":  # torch.cpu, and devices like it, have no lazy start-up a probe could trigger
        pytest.skip(
            f"{device_name}'s device module is initialised from the start (tests/test_platform_generic.py "
            "checks the rule on a stub device)"
        )
    assert after == "False", "probe() initialised the device"


def test_identity(platform, device_name):
    assert platform.name == device_name
    assert default_registry().get(device_name) is platform
    assert torch.device(platform.torch_device_type).type == platform.torch_device_type
    assert platform.dispatch_key and platform.distributed_backend
    assert platform.visible_devices_env is None or platform.visible_devices_env.isupper()


def test_capabilities_record(platform):
    caps = platform.capabilities
    assert isinstance(caps, Capabilities) and platform.capabilities is caps  # computed once
    assert caps.device_name
    assert torch.float32 in caps.model_dtypes
    assert all(isinstance(d, torch.dtype) and d.is_floating_point for d in caps.model_dtypes)
    assert set(caps.model_dtypes) <= set(caps.kv_cache_dtypes)
    for fp8 in (caps.fp8_e4m3_dtype, caps.fp8_e5m2_dtype):
        assert fp8 is None or (fp8.itemsize == 1 and fp8.is_floating_point)


def test_tensors_in_every_model_and_kv_dtype(platform):
    ref = torch.linspace(-4, 4, 64)
    for dtype in platform.capabilities.kv_cache_dtypes:
        on_device = ref.to(platform.device(0)).to(dtype)
        assert on_device.device.type == platform.torch_device_type and on_device.dtype == dtype
        back = on_device.float().cpu()
        # Round-trip within the dtype's own precision (fp8 keeps 2-3 mantissa bits).
        assert torch.allclose(back, ref, rtol=0.25 if dtype.itemsize == 1 else 1e-2, atol=0.1)


def test_device_control(platform):
    platform.set_device(0)
    assert platform.current_device() == 0
    x = torch.ones(1024, device=platform.device())
    assert x.device == platform.device(0)
    with pytest.raises(Exception):  # noqa: B017 (vendors raise their own errors for a bad index)
        platform.set_device(platform.device_count())  # one past the last device
    assert platform.current_device() == 0


def test_synchronize_waits_for_queued_work(platform):
    x = torch.randn(512, 512, device=platform.device())
    done = platform.event()
    for _ in range(4):
        x = x @ x / 23
    done.record()
    platform.synchronize()
    assert done.query(), "work queued before synchronize() must be finished when it returns"
    platform.synchronize(0)


def test_events_time_what_happens_between_them(platform):
    stream = platform.stream()
    assert stream.device.type == platform.torch_device_type
    start, end = platform.event(enable_timing=True), platform.event(enable_timing=True)
    platform.synchronize()  # an idle device records each event as soon as it is queued
    start.record(stream)
    begun = time.perf_counter()
    time.sleep(0.05)
    end.record(stream)
    end.synchronize()
    waited_ms = (time.perf_counter() - begun) * 1e3
    assert end.query()
    assert 40 <= start.elapsed_time(end) <= waited_ms + 20


def test_work_on_a_platform_stream_is_timed_by_events(platform):
    x = torch.ones(256, 256, device=platform.device())
    stream = platform.stream()
    platform.synchronize()  # x was written on the default stream
    start, end = platform.event(enable_timing=True), platform.event(enable_timing=True)
    with stream:
        start.record(stream)
        y = x @ x
        end.record(stream)
    end.synchronize()
    assert end.query()
    assert start.elapsed_time(end) >= 0.0
    assert y[0, 0].item() == 256


def test_manual_seed_is_reproducible(platform):
    platform.manual_seed(1234)
    a = torch.randn(256, device=platform.device())
    platform.manual_seed(1234)
    b = torch.randn(256, device=platform.device())
    assert torch.equal(a, b)


def test_memory_probe(platform):
    free, total = platform.memory_info()
    assert isinstance(free, int) and isinstance(total, int)
    assert 0 < free <= total
    assert platform.memory_info(0)[1] == total
    platform.empty_cache()


def test_peak_memory_grows_with_an_allocation_and_resets(platform):
    platform.synchronize()
    platform.reset_peak_memory()
    before = platform.peak_memory_allocated()
    block = torch.ones(128 * MIB, dtype=torch.uint8, device=platform.device())
    platform.synchronize()
    with_block = platform.peak_memory_allocated()
    assert with_block >= before + 0.9 * block.numel()
    del block
    platform.empty_cache()
    platform.reset_peak_memory()
    assert platform.peak_memory_allocated() <= with_block - 0.5 * 128 * MIB


def test_world_size_one_all_reduce(platform):
    if dist.is_initialized():  # a tensor-parallel runner of an earlier test that was never closed
        dist.destroy_process_group()
    init_distributed(platform, plan_world(1), timeout_s=60)
    try:
        assert dist.get_backend() == platform.distributed_backend
        x = torch.arange(8, dtype=torch.float32, device=platform.device())
        dist.all_reduce(x)
        platform.synchronize()
        assert torch.equal(x.cpu(), torch.arange(8, dtype=torch.float32))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_attention_backends(platform, mode):
    offered = platform.attention_backends()
    assert "torch_native" in offered  # the reference backend runs on every device
    for dtype in platform.capabilities.model_dtypes:  # a default for every dtype, one that computes in it
        default = platform.attention_offer(platform.default_attention_backend_for(mode, dtype))
        assert default.name in offered and default.serves(dtype) and not default.on_request


def test_deterministic_attention_backends_are_all_batch_invariant(platform):
    offered = platform.deterministic_attention_backends()
    assert offered[-1] == "batch_invariant"  # the device-neutral one runs wherever torch does
    assert all(platform.attention_offer(name).batch_invariant for name in offered), offered


def _op_inputs(name: str, dtype: torch.dtype, device: torch.device, fused: dict) -> tuple:
    """Arguments for one op of the table, as the layers pass them (a Qwen-like head size, 5 tokens)."""
    gen = torch.Generator().manual_seed(len(name))

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device, dtype)

    if name == "linear":
        weight = rand(96, 64, scale=0.125)
        prepare = fused.get("prepare_linear", native_ops.prepare_linear)
        return rand(5, 64), weight, rand(96), prepare(weight)
    if name == "batch_invariant_linear":  # deterministic mode's linear: plain weights, nothing prepared
        return rand(5, 64), rand(96, 64, scale=0.125), rand(96), None
    if name == "rms_norm":
        return rand(5, 64), rand(64), 1e-6
    if name == "add_rms_norm":
        return rand(5, 64), rand(5, 64), rand(64), 1e-6
    if name == "silu_and_mul":
        return (rand(5, 2 * 48),)
    if name == "argmax":
        logits = rand(3, 10_000)
        logits[0, 17] = logits[0, 9_000] = logits[0].max() + 1  # ties go to the first index
        logits[1, 4_096] = float("inf")
        return (logits,)
    if name == "sample":
        # Seeded rows with every filter (logits in halves: ties at the cuts), sampled with the batch's keys: a
        # filter that keeps one token too many or too few shows in some row's draw.
        rows = 32
        logits = (rand(rows, 1_000, scale=4.0).float().round() / 2).to(dtype)
        filters = [
            dict(temperature=0.7),
            dict(top_k=5),
            dict(temperature=1.3, top_p=0.6),
            dict(temperature=0.9, min_p=0.1),
            dict(temperature=0.8, top_k=40, top_p=0.9, min_p=0.02),
            dict(top_k=1),
            dict(temperature=2.0, top_p=0.3),
            dict(temperature=0.5, top_k=3, top_p=0.5),
        ]
        params = [SamplingParams(**filters[i % len(filters)], seed=i) for i in range(rows)]
        return logits, SamplingBatch.build(params, list(range(rows)), device, vocab_size=logits.shape[1])
    if name == "apply_penalties":
        # Four batch rows reading three of five pool rows (one twice), every penalty on somewhere and off somewhere.
        counts = torch.randint(0, 3, (5, 1_000), generator=gen, dtype=torch.int32)
        counts = (counts * (torch.rand(5, 1_000, generator=gen) < 0.3)).to(device)
        prompt_seen = (torch.rand(5, 1_000, generator=gen) < 0.1).to(device)
        rows = torch.tensor([4, 0, 4, 2], device=device)
        penalties = torch.tensor([[1.0, 1.5, 0.7, 1.2], [0.0, 0.4, -0.3, 1.1], [0.0, -1.0, 0.5, 0.2]], device=device)
        return rand(4, 1_000, scale=3.0), counts, prompt_seen, rows, *penalties
    if name == "apply_token_bitmask":
        # Rows all allowed, none, every other token, and a random third; a vocabulary that ends mid-word.
        words = (1_000 + 31) // 32
        bitmask = torch.randint(-(2**31), 2**31 - 1, (4, words), generator=gen, dtype=torch.int32)
        bitmask[0], bitmask[1], bitmask[2] = -1, 0, 0x55555555
        return rand(4, 1_000, scale=3.0), bitmask.to(device)
    if name == "fused_moe":
        # 7 tokens over 4 experts, top 2: expert 0 takes every token, expert 3 none.
        logits = torch.randn(7, 4, generator=gen)
        logits[:, 0] += 20.0
        logits[:, 3] -= 40.0
        return rand(7, 32), logits.to(device), rand(4, 2 * 16, 32, scale=0.2), rand(4, 32, 16, scale=0.25), 2, True
    if name == "fp8_fused_moe":
        # fused_moe's routing over experts kept in fp8, 128 x 128 blocks; hidden 200 leaves partial blocks.
        logits = torch.randn(7, 4, generator=gen)
        logits[:, 0] += 20.0
        logits[:, 3] -= 40.0

        def experts(rows, cols):
            weight = (torch.randn(4, rows, cols, generator=gen) * 8).clamp(-448, 448).to(torch.float8_e4m3fn)
            scale = torch.rand(4, -(-rows // 128), -(-cols // 128), generator=gen) * 1e-2 + 1e-3
            return weight.to(device), scale.to(device)

        (w13, s13), (w2, s2) = experts(2 * 128, 200), experts(200, 128)
        return rand(7, 200), logits.to(device), w13, s13, w2, s2, 2, True, 0, (128, 128)
    if name == "int4_fused_moe":
        # fused_moe's routing over experts kept in 4 bits, groups of 32 (a partial last one over hidden 200), zero
        # points over the whole 0..15 range.
        logits = torch.randn(7, 4, generator=gen)
        logits[:, 0] += 20.0
        logits[:, 3] -= 40.0

        def experts(rows, cols):
            packed = torch.randint(-(2**31), 2**31, (4, rows, cols // 8), generator=gen, dtype=torch.int64)
            scale = torch.rand(4, rows, -(-cols // 32), generator=gen) * 0.01 + 0.001
            zero = torch.randint(0, 16, scale.shape, generator=gen).to(torch.uint8)
            return packed.to(torch.int32).to(device), scale.to(device), zero.to(device)

        w13, w2 = experts(2 * 64, 200), experts(200, 64)
        prepare = fused.get("prepare_int4_fused_moe", native_ops.prepare_int4_fused_moe)
        return rand(7, 200), logits.to(device), *w13, *w2, 2, True, 0, 32, prepare(*w13, *w2, 32)
    if name == "fp8_linear":
        # Decode-sized rows, 128 x 128 blocks with partial last ones; a larger batch is the kernels' own test.
        weight = (torch.randn(200, 384, generator=gen) * 8).clamp(-448, 448).to(torch.float8_e4m3fn).to(device)
        scale = (torch.rand(2, 3, generator=gen) * 1e-2 + 1e-3).to(device)
        prepare = fused.get("prepare_fp8_linear", native_ops.prepare_fp8_linear)
        return rand(5, 384), weight, scale, rand(200), (128, 128), prepare(weight, scale, (128, 128))
    if name == "int4_linear":
        # Decode-sized rows, groups of 32 (several a kernel's K step) with a partial last one; the packed words hold
        # random 4-bit values, zero points the whole 0..15 range. Larger batches are the kernels' own test.
        packed = torch.randint(-(2**31), 2**31, (200, 37), generator=gen, dtype=torch.int64).to(torch.int32)
        scale = torch.rand(200, 10, generator=gen) * 0.02 + 0.002
        zero = torch.randint(0, 16, (200, 10), generator=gen).to(torch.uint8)
        packed, scale, zero = packed.to(device), scale.to(device), zero.to(device)
        prepare = fused.get("prepare_int4_linear", native_ops.prepare_int4_linear)
        return rand(5, 296), packed, scale, zero, rand(200), 32, prepare(packed, scale, zero, 32)
    if name == "rotary_embedding":
        table = torch.randn(64, 32, generator=gen).to(device)  # float32 [positions, head_dim]: cos | sin
        positions = torch.tensor([0, 3, 9, 17, 63], device=device)
        return positions, rand(5, 4 * 32), rand(5, 2 * 32), table, 32
    raise AssertionError(f"no inputs for op {name!r}: add them here")


def test_fused_ops_match_the_torch_native_references(platform):
    fused = dict(platform.fused_ops())
    assert set(fused) <= set(OP_NAMES), f"unknown op names: {sorted(set(fused) - set(OP_NAMES))}"
    resolve_ops(fused)  # a consistent table (linear comes with prepare_linear)
    device = platform.device()
    for dtype in platform.capabilities.model_dtypes:
        tolerance = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 2e-2}
        for name, op in fused.items():
            if name.startswith("prepare_") or name.endswith("_takes"):
                continue  # checked through its op (which takes what it prepared) and the models that keep weights
            args = _op_inputs(name, dtype, device, fused)
            reference_args = args[:-1] + (None,) if name == "linear" else args
            # The reference first, on copies: a fused op may work in place (triton's add_rms_norm writes its inputs).
            expected = getattr(Ops(), name)(*(a.clone() if torch.is_tensor(a) else a for a in reference_args))
            got = op(*args)
            for g, e in zip(*(t if isinstance(t, tuple) else (t,) for t in (got, expected)), strict=True):
                assert g.dtype == e.dtype and g.shape == e.shape, name
                if not e.is_floating_point():  # argmax's and sample's token ids: exactly the reference's
                    assert torch.equal(g, e), f"{name} in {dtype}: {g.tolist()} != {e.tolist()}"
                    continue
                torch.testing.assert_close(g.float(), e.float(), **tolerance, msg=f"{name} in {dtype}")
