"""plan_kv_pool arithmetic and resolve_kv_cache_dtype, on hand-computed numbers and hand-built Capabilities."""

from __future__ import annotations

import pytest
import torch

from omnirun.errors import ConfigError, KVPoolTooSmallError
from omnirun.memory import plan_kv_pool, resolve_kv_cache_dtype
from omnirun.platform import Capabilities

GiB = 2**30
LLAMA8B_BPT = 131072  # 32 layers x 8 KV heads x 128 x 2 bytes x (K and V)
# A token cap past any memory: it replaces the running-limit cap, so memory alone sizes the pool.
NO_CAP = 10**15


def plan(**overrides):
    args = dict(
        free_bytes=60 * GiB,
        total_bytes=80 * GiB,
        mem_fraction_static=0.75,
        bytes_per_token=LLAMA8B_BPT,
        page_size=16,
        context_length=4096,
        max_running_requests=80,  # 80 x 4096 tokens: more than memory holds, so memory is the cap
        reserved_bytes=1 * GiB,
    )
    args.update(overrides)
    return plan_kv_pool(**args)


def test_arithmetic_on_hand_computed_numbers():
    p = plan()
    # req_to_token: 80 requests x 4096 positions x 4 bytes = 1310720 bytes.
    assert p.req_to_token_bytes == 1310720
    # budget = 60 GiB - 80 GiB x 0.25 - 1 GiB - 1310720 = 39 GiB - 1310720 bytes = 41874620416 bytes
    # -> 41874620416 // 131072 = 319478 tokens -> 19967 whole pages of 16, one of them the padding page.
    assert p.num_pages == 19966
    assert p.num_tokens == 19966 * 16 == 319456
    assert p.page_size == 16 and p.max_running_requests == 80
    assert p.kv_bytes == 19967 * 16 * LLAMA8B_BPT
    assert p.kv_bytes <= 39 * GiB - 1310720, "the buffers, padding page included, stay within the budget"
    assert p.explanation.endswith("capped by memory (mem_fraction_static 0.75)")


def test_page_size_one_and_rounding_down_to_pages():
    # budget = 10 GiB - 16 GiB x 0.5 - 0 - (1 x 100 x 4) = 2 GiB - 400 bytes; 1000 bytes per token.
    budget = 2 * GiB - 400
    p1 = plan(
        free_bytes=10 * GiB,
        total_bytes=16 * GiB,
        mem_fraction_static=0.5,
        bytes_per_token=1000,
        page_size=1,
        context_length=100,
        max_running_requests=1,
        reserved_bytes=0,
        max_total_tokens=NO_CAP,
    )
    assert p1.num_tokens == budget // 1000 - 1 == 2147482
    p64 = plan(
        free_bytes=10 * GiB,
        total_bytes=16 * GiB,
        mem_fraction_static=0.5,
        bytes_per_token=1000,
        page_size=64,
        context_length=100,
        max_running_requests=1,
        reserved_bytes=0,
        max_total_tokens=NO_CAP,
    )
    assert p64.num_pages == (budget // 1000) // 64 - 1 == 33553
    assert p64.num_tokens == 33553 * 64


def test_fraction_one_gives_all_free_memory():
    p = plan(
        free_bytes=4 * GiB,
        mem_fraction_static=1.0,
        bytes_per_token=1024,
        page_size=1,
        reserved_bytes=0,
        max_running_requests=1,
        context_length=1024,
        max_total_tokens=NO_CAP,
    )
    assert p.num_tokens == (4 * GiB - 4096) // 1024 - 1


def test_max_total_tokens_caps_the_pool():
    p = plan(max_total_tokens=100_000)
    assert p.num_pages == 100_000 // 16 == 6250
    assert p.num_tokens == 100_000
    assert "capped by --max-total-tokens 100000" in p.explanation


def test_max_total_tokens_beyond_what_fits_uses_what_fits():
    p = plan(max_total_tokens=10**9)
    assert p.num_pages == 19966
    assert "does not fit, using what fits" in p.explanation


def test_explanation_is_one_line_with_the_numbers():
    text = plan().explanation
    assert "\n" not in text
    for part in ("60.00 GiB", "80.00 GiB", "0.75", "1.00 GiB", "1.25 MiB", "131072 B/token", "319478 tokens"):
        assert part in text
    assert "19966 pages" in text or "19967 pages" in text


def test_too_small_names_the_fix():
    # budget = 21 GiB - 80 GiB x 0.25 - 1 GiB - 131072 < 0: nothing fits.
    with pytest.raises(KVPoolTooSmallError) as info:
        plan(free_bytes=21 * GiB)
    msg = str(info.value)
    assert "\n" not in msg
    assert "holds 0 tokens" in msg and "--context-length 4096" in msg
    assert "raise --mem-fraction-static (now 0.75), lower --context-length" in msg
    assert "--max-total-tokens" not in msg


def test_just_too_small_and_just_enough():
    # A budget of exactly 4096 + 16 tokens holds one request of 4096 tokens plus the padding page.
    req_bytes = 80 * 4096 * 4
    enough = 20 * GiB + 1 * GiB + req_bytes + (4096 + 16) * LLAMA8B_BPT
    assert plan(free_bytes=enough).num_tokens == 4096
    with pytest.raises(KVPoolTooSmallError, match="holds 4080 tokens"):
        plan(free_bytes=enough - 1)


def test_too_small_because_of_the_cap_says_raise_the_cap():
    with pytest.raises(KVPoolTooSmallError, match=r"raise --max-total-tokens \(now 2000\), raise --mem-fraction"):
        plan(max_total_tokens=2000)


@pytest.mark.parametrize(
    ("overrides", "flag"),
    [
        ({"mem_fraction_static": 0.0}, "--mem-fraction-static"),
        ({"mem_fraction_static": 1.5}, "--mem-fraction-static"),
        ({"mem_fraction_static": float("nan")}, "--mem-fraction-static"),
        ({"page_size": 0}, "--page-size"),
        ({"context_length": 0}, "--context-length"),
        ({"max_running_requests": 0}, "--max-running-requests"),
        ({"max_total_tokens": 0}, "--max-total-tokens"),
        ({"bytes_per_token": 0}, "bytes_per_token"),
        ({"reserved_bytes": -1}, "reserved_bytes"),
        ({"free_bytes": 81 * GiB}, "memory_info"),
    ],
)
def test_bad_inputs_are_config_errors(overrides, flag):
    with pytest.raises(ConfigError, match=flag):
        plan(**overrides)


# --- resolve_kv_cache_dtype ---


def caps(fp8: str | None) -> Capabilities:
    e4m3, e5m2 = {
        None: (None, None),
        "fn": (torch.float8_e4m3fn, torch.float8_e5m2),
        "fnuz": (torch.float8_e4m3fnuz, torch.float8_e5m2fnuz),
    }[fp8]
    return Capabilities(
        device_name=f"TestGPU-{fp8}",
        model_dtypes=(torch.bfloat16, torch.float16, torch.float32),
        fp8_e4m3_dtype=e4m3,
        fp8_e5m2_dtype=e5m2,
        supports_triton=False,
    )


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("auto", torch.bfloat16),
        ("bf16", torch.bfloat16),
        ("bfloat16", torch.bfloat16),
        ("fp16", torch.float16),
        ("float16", torch.float16),
        ("fp32", torch.float32),
        ("float32", torch.float32),
        ("FP8_E4M3", torch.float8_e4m3fn),
        ("fp8_e5m2", torch.float8_e5m2),
    ],
)
def test_names_resolve(name, expected):
    assert resolve_kv_cache_dtype(name, torch.bfloat16, caps("fn")) == expected


def test_auto_is_the_model_dtype():
    assert resolve_kv_cache_dtype("auto", torch.float16, caps(None)) == torch.float16


def test_fp8_follows_the_platform_flavour():
    assert resolve_kv_cache_dtype("fp8_e4m3", torch.bfloat16, caps("fnuz")) == torch.float8_e4m3fnuz
    assert resolve_kv_cache_dtype("fp8_e5m2", torch.bfloat16, caps("fnuz")) == torch.float8_e5m2fnuz


def test_fp8_without_fp8_names_the_valid_choices():
    with pytest.raises(ConfigError) as info:
        resolve_kv_cache_dtype("fp8_e4m3", torch.bfloat16, caps(None))
    assert str(info.value) == (
        "--kv-cache-dtype fp8_e4m3 is not supported on TestGPU-None: choose one of auto, bf16, fp16, fp32"
    )


def test_unsupported_model_dtype_in_auto_and_unknown_names():
    no_bf16 = Capabilities("OldGPU", (torch.float16, torch.float32), None, None, False, None)
    with pytest.raises(ConfigError, match=r"auto \(model dtype torch.bfloat16\) is not supported on OldGPU"):
        resolve_kv_cache_dtype("auto", torch.bfloat16, no_bf16)
    with pytest.raises(ConfigError, match="not supported on OldGPU: choose one of fp16, fp32$"):
        resolve_kv_cache_dtype("bf16", torch.bfloat16, no_bf16)
    all_choices = "auto, bf16, fp16, fp32, fp8_e4m3, fp8_e5m2"
    with pytest.raises(ConfigError, match=f"'int4' is unknown: choose one of {all_choices}"):
        resolve_kv_cache_dtype("int4", torch.bfloat16, caps("fn"))


def test_the_smallest_valid_values_are_accepted():
    # a one-token context, one-byte tokens, free == total: legal inputs (1000 B - 4 B of table = 996 tokens)
    smallest = dict(mem_fraction_static=1.0, bytes_per_token=1, page_size=1, context_length=1, max_running_requests=1)
    tiny = plan_kv_pool(free_bytes=1000, total_bytes=1000, max_total_tokens=NO_CAP, **smallest)
    assert tiny.num_tokens == 995  # one page of the budget pads
    # one running request of one token can use one slot
    assert plan_kv_pool(free_bytes=1000, total_bytes=1000, **smallest).num_tokens == 1
    assert plan_kv_pool(free_bytes=1000, total_bytes=1000, max_total_tokens=1, **smallest).num_tokens == 1
    # a one-byte device, or nothing free, are legal probe answers: the pool is too small, the input is not bad
    for free, total in ((1, 1), (0, 1000)):
        with pytest.raises(KVPoolTooSmallError):
            plan_kv_pool(free_bytes=free, total_bytes=total, **smallest)


def test_a_cap_equal_to_what_fits_is_still_a_cap():
    fits = plan().num_tokens
    capped = plan(max_total_tokens=fits)
    assert capped.num_tokens == fits and f"capped by --max-total-tokens {fits}" in capped.explanation
    assert "does not fit" in plan(max_total_tokens=fits + 16).explanation


def test_default_running_requests_follow_the_pool_within_bounds():
    from omnirun.memory import default_max_running_requests
    from omnirun.memory.sizing import DEFAULT_RUNNING_REQUESTS, DEFAULT_TOKENS_PER_REQUEST

    assert DEFAULT_RUNNING_REQUESTS == (256, 1024) and DEFAULT_TOKENS_PER_REQUEST == 512
    assert default_max_running_requests(4096) == 256  # a small pool keeps the floor
    assert default_max_running_requests(300 * 512 + 511) == 300
    assert default_max_running_requests(836_030) == 1024  # Llama-3-8B's pool on an H200
    assert default_max_running_requests(10**9) == 1024


# 200,000 tokens at 512 a request would be 390 requests, but 390 requests of the context length (256) hold only
# 99,840 of them: the limit is the 782 requests it takes to fill the pool.
@pytest.mark.parametrize(("pool_tokens", "rows"), [(4096, 256), (200_000, 782)])
def test_a_runner_without_the_flag_takes_its_running_limit_from_the_pool(tiny_checkpoints, pool_tokens, rows):
    from omnirun.devices.cpu.platform import CpuPlatform
    from omnirun.testing import make_runner

    runner = make_runner(CpuPlatform(), tiny_checkpoints["llama"].plain, max_total_tokens=pool_tokens)
    try:
        assert runner.kv.total_tokens == pool_tokens
        assert runner.max_running_requests == rows == runner.kv.req_to_token.max_requests
        assert runner.describe()["max_running_requests"] == rows  # what the start-up line shows
    finally:
        runner.close()
    runner = make_runner(
        CpuPlatform(), tiny_checkpoints["llama"].plain, max_total_tokens=pool_tokens, max_running_requests=3
    )
    try:
        assert runner.max_running_requests == 3 == runner.kv.req_to_token.max_requests  # the flag wins
    finally:
        runner.close()


def test_a_plan_without_a_running_limit_takes_the_pools_default_and_budgets_the_largest_table():
    p = plan(max_running_requests=None)
    # The table is budgeted for 1,024 rows: 1024 x 4096 x 4 bytes taken out of the 39 GiB budget.
    assert p.req_to_token_bytes == 1024 * 4096 * 4
    assert p.num_tokens == ((39 * GiB - 1024 * 4096 * 4) // LLAMA8B_BPT // 16 - 1) * 16
    assert p.max_running_requests == 623 == p.num_tokens // 512
    assert "at most 623 running requests (no --max-running-requests" in p.explanation


# --- the caps on the pool: each can win, and the explanation names the one that did ---


def test_the_running_limit_caps_the_pool_at_its_requests_of_the_context_length():
    p = plan(max_running_requests=8)  # memory holds 19,966 pages of 16
    assert p.num_pages == 8 * 4096 // 16 == 2048 and p.num_tokens == 8 * 4096
    assert p.explanation.endswith("capped by running limit --max-running-requests 8 x context length 4096")


def test_the_running_cap_rounds_a_request_up_to_whole_pages():
    p = plan(max_running_requests=1, context_length=100)  # 100 tokens take 7 pages of 16
    assert p.num_pages == 7 and p.num_tokens == 112


def test_without_the_flag_the_cap_is_the_defaults_most_and_the_limit_fills_the_pool():
    p = plan(max_running_requests=None, context_length=64)  # memory holds ~20k pages of 16
    assert p.num_tokens == 1024 * 64
    assert "capped by running limit 1024 (the default's most) x context length 64" in p.explanation
    # the limit follows the capped pool: 65,536 tokens at 512 a request would be 128 (so 256), but 1,024 requests
    # of 64 tokens are what it takes to fill it
    assert p.max_running_requests == 1024


@pytest.mark.parametrize("context_length", [16, 100, 256, 513, 4096])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("free_gib", [22, 40, 80])
def test_the_default_limit_can_always_fill_the_pool(context_length, page_size, free_gib):
    """No circle: the cap takes the default's upper bound, the limit comes from the capped pool, and the pool is
    never more than the limit's requests of the context length can hold."""
    p = plan(
        free_bytes=int(free_gib * GiB), max_running_requests=None, context_length=context_length, page_size=page_size
    )
    request_pages = -(-context_length // page_size)
    assert 256 <= p.max_running_requests <= 1024
    assert p.num_pages <= p.max_running_requests * request_pages


def test_a_platforms_default_budget_caps_the_pool():
    p = plan(default_kv_bytes=1 * GiB)  # 8,192 tokens of 128 KiB: 512 pages, one of them padding
    assert p.num_pages == 511
    assert p.explanation.endswith("capped by the platform's default KV budget 1.00 GiB")


def test_a_platforms_default_budget_holds_at_least_one_request():
    p = plan(default_kv_bytes=1)
    assert p.num_tokens == 4096 and "capped by the platform's default KV budget" in p.explanation


def test_max_total_tokens_replaces_the_default_caps():
    """A pool past what the running requests fill keeps finished prefixes cached: the user may ask for one."""
    p = plan(max_running_requests=1, default_kv_bytes=1 * GiB, max_total_tokens=100_000)
    assert p.num_tokens == 100_000 and p.explanation.endswith("capped by --max-total-tokens 100000")
    assert "default KV budget" not in p.explanation and "running limit" not in p.explanation


def test_memory_still_caps_the_defaults():
    p = plan(free_bytes=22 * GiB, default_kv_bytes=4 * GiB)  # 1 GiB - 1.25 MiB of budget, of 4
    assert p.num_pages == (1 * GiB - 80 * 4096 * 4) // LLAMA8B_BPT // 16 - 1 == 510
    assert p.explanation.endswith("capped by memory (mem_fraction_static 0.75)")


# --- the runner: the CPU's default budget, and two embedded models at once ---


def _kv_log(caplog) -> str:
    return next(r.getMessage() for r in caplog.records if r.getMessage().startswith("KV cache: "))


def test_the_cpu_runner_caps_its_pool_at_the_cpus_default_budget(tiny_checkpoints, monkeypatch, caplog):
    from omnirun.devices.cpu.platform import CpuPlatform
    from omnirun.memory import PagedKVCache
    from omnirun.testing import make_runner

    monkeypatch.setattr(CpuPlatform, "default_kv_cache_space", 1 << 20)
    with caplog.at_level("INFO", logger="omnirun.runner"):
        runner = make_runner(CpuPlatform(), tiny_checkpoints["llama"].plain, max_total_tokens=None)
    try:
        shape = runner.shape
        per_token = PagedKVCache.bytes_per_token(shape.num_layers, shape.num_kv_heads, shape.head_dim, runner.dtype)
        assert runner.kv.total_tokens == (1 << 20) // per_token - 1
        assert _kv_log(caplog).endswith(
            "capped by the platform's default KV budget 1.00 MiB; at most 256 running requests (no "
            "--max-running-requests: 512 tokens each, within 256..1024, enough to fill the pool)"
        )
    finally:
        runner.close()
    caplog.clear()
    with caplog.at_level("INFO", logger="omnirun.runner"):  # a fraction given: the user sized the pool
        runner = make_runner(
            CpuPlatform(), tiny_checkpoints["llama"].plain, max_total_tokens=None, mem_fraction_static=1.0
        )
    try:
        assert runner.kv.total_tokens == 1024 * 256  # the running limit's cap
        assert "default KV budget" not in _kv_log(caplog) and "capped by running limit 1024" in _kv_log(caplog)
    finally:
        runner.close()


def test_cpu_ranks_of_one_node_share_the_default_budget():
    from omnirun.devices.cpu.platform import CpuPlatform

    platform = CpuPlatform()
    assert platform.default_kv_cache_bytes() == 4 << 30
    platform.bind_rank(0, 4)
    try:
        assert platform.default_kv_cache_bytes() == 1 << 30
    finally:
        platform.unbind_rank()


def test_two_embedded_models_are_open_at_once_on_the_cpu_with_default_settings():
    from omnirun.engine import LLM
    from omnirun.sampling import SamplingParams

    greedy = SamplingParams(temperature=0, max_new_tokens=4)
    with LLM(device="cpu") as first, LLM(device="cpu") as second:
        for llm in (first, second):
            # the running limit's cap: 1,024 requests of the context length (1,024), a quarter of the CPU's budget
            assert llm.runner.kv.total_tokens == 1024 * 1024
            assert len(llm.generate("Hello", greedy, use_tqdm=False)[0].token_ids) == 4
