"""How many KV-cache pages fit in device memory: pure arithmetic on the platform's memory probe."""

from __future__ import annotations

import dataclasses

from omnirun.errors import ConfigError, KVPoolTooSmallError

_REQ_TO_TOKEN_ENTRY_BYTES = 4  # the request-to-token table is int32

# Without --max-running-requests, as many requests run at once as the pool holds at DEFAULT_TOKENS_PER_REQUEST
# tokens each, between the bounds. Llama-3-8B on an H200 holds ~836k tokens, so 1,024: 1,000 prompts of 256 -> 256
# ran at 15,911 output tok/s there against 14,370 with 256 running
# (bench/results/h200_offline_bs{256,1024}_1000_f81960b.json). A small device keeps 256. The table is sized for the
# upper bound while the pool is planned, and the pool is capped at what that bound's requests can fill.
DEFAULT_RUNNING_REQUESTS = (256, 1024)
DEFAULT_TOKENS_PER_REQUEST = 512


def default_max_running_requests(pool_tokens: int, request_tokens: int | None = None) -> int:
    """The running-request limit for a pool of `pool_tokens` when the user sets none: DEFAULT_TOKENS_PER_REQUEST
    tokens each, within the bounds, and at least enough requests of `request_tokens` (the context length, in whole
    pages) to fill the pool, or part of it could never hold a running request."""
    low, high = DEFAULT_RUNNING_REQUESTS
    limit = max(low, pool_tokens // DEFAULT_TOKENS_PER_REQUEST)
    if request_tokens is not None:
        limit = max(limit, -(-pool_tokens // request_tokens))
    return min(high, limit)


@dataclasses.dataclass(frozen=True)
class KVPoolPlan:
    """The KV pool to build: `num_pages` usable pages (ids 1..num_pages) plus the padding page 0."""

    num_pages: int
    page_size: int
    num_tokens: int  # usable slots: num_pages * page_size
    max_running_requests: int
    req_to_token_bytes: int
    kv_bytes: int  # K and V buffers of all layers, the padding page included
    explanation: str  # one line for the log


def _size(n: float) -> str:
    """Bytes in GiB, or MiB below 1 GiB, for humans."""
    if abs(n) >= 2**30:
        return f"{n / 2**30:.2f} GiB"
    return f"{n / 2**20:.2f} MiB"


def _caps(
    fit_pages: int,
    mem_fraction_static: float,
    bytes_per_token: int,
    page_size: int,
    context_length: int,
    table_rows: int,
    default_rows: bool,
    max_total_tokens: int | None,
    default_kv_bytes: int | None,
) -> list[tuple[int, str]]:
    """(pages, name) of every cap on the pool, the user's first. --max-total-tokens replaces the two default caps:
    a pool larger than the running requests can fill still keeps finished requests' prefixes cached."""
    memory = (fit_pages, f"memory (mem_fraction_static {mem_fraction_static:g})")
    if max_total_tokens is not None:
        return [(max_total_tokens // page_size, f"--max-total-tokens {max_total_tokens}"), memory]
    pages_per_request = -(-context_length // page_size)
    limit = f"{table_rows} (the default's most)" if default_rows else f"--max-running-requests {table_rows}"
    caps = [(table_rows * pages_per_request, f"running limit {limit} x context length {context_length}")]
    if default_kv_bytes is not None:
        # A default, so never below one request of the context length (memory still caps it).
        default_pages = max(default_kv_bytes // bytes_per_token // page_size - 1, pages_per_request)
        caps.append((default_pages, f"the platform's default KV budget {_size(default_kv_bytes)}"))
    return [*caps, memory]


def _validate(
    free_bytes: int,
    total_bytes: int,
    mem_fraction_static: float,
    bytes_per_token: int,
    page_size: int,
    context_length: int,
    max_running_requests: int | None,
    max_total_tokens: int | None,
    reserved_bytes: int,
) -> None:
    if not 0 < mem_fraction_static <= 1:
        raise ConfigError(f"--mem-fraction-static {mem_fraction_static} is out of range: use a value in (0, 1]")
    if page_size < 1:
        raise ConfigError(f"--page-size {page_size} is invalid: use a page size >= 1")
    if context_length < 1:
        raise ConfigError(f"--context-length {context_length} is invalid: use a length >= 1")
    if max_running_requests is not None and max_running_requests < 1:
        raise ConfigError(f"--max-running-requests {max_running_requests} is invalid: use a value >= 1")
    if max_total_tokens is not None and max_total_tokens < 1:
        raise ConfigError(f"--max-total-tokens {max_total_tokens} is invalid: use a value >= 1 or leave it unset")
    if bytes_per_token < 1:
        raise ConfigError(f"bytes_per_token {bytes_per_token} is invalid: the KV cache needs >= 1 byte per token")
    if reserved_bytes < 0:
        raise ConfigError(f"reserved_bytes {reserved_bytes} is invalid: reserve >= 0 bytes")
    if total_bytes < 1 or not 0 <= free_bytes <= total_bytes:
        raise ConfigError(
            f"device memory probe gave free={free_bytes} total={total_bytes} bytes: the platform's memory_info() "
            "must return 0 <= free <= total, total > 0"
        )


def plan_kv_pool(
    *,
    free_bytes: int,
    total_bytes: int,
    mem_fraction_static: float,
    bytes_per_token: int,
    page_size: int,
    context_length: int,
    max_running_requests: int | None,
    max_total_tokens: int | None = None,
    reserved_bytes: int = 0,
    default_kv_bytes: int | None = None,
) -> KVPoolPlan:
    """Size the KV pool from the memory left after the weights are loaded (SGLang's arithmetic), then cap it.

    The static share of the device, `total_bytes * mem_fraction_static`, holds the weights and the KV cache; the
    weights are already loaded (they are no longer in `free_bytes`), so the KV budget is what is free minus the
    non-static share, minus `reserved_bytes` (e.g. graph memory), minus the request-to-token table. The budget
    also pays for the padding page 0, so the buffers actually allocated never exceed it.

    The pool is the smallest of the caps: that memory budget; `max_total_tokens` when given; else what the running
    limit can fill (its rows x the context length) and `default_kv_bytes` (a platform's default pool size, the
    CPU's) when given. `max_running_requests` None: the running limit is at most DEFAULT_RUNNING_REQUESTS[1] (the
    cap uses that), and the plan's limit is then `default_max_running_requests` of the capped pool: the cap comes
    from the largest limit the default may pick, the limit from the pool, so neither waits on the other.
    """
    _validate(
        free_bytes,
        total_bytes,
        mem_fraction_static,
        bytes_per_token,
        page_size,
        context_length,
        max_running_requests,
        max_total_tokens,
        reserved_bytes,
    )
    # Without a limit the table is budgeted for the default's upper bound; the limit then follows the pool.
    table_rows = max_running_requests or DEFAULT_RUNNING_REQUESTS[1]
    req_to_token_bytes = table_rows * context_length * _REQ_TO_TOKEN_ENTRY_BYTES
    non_static = total_bytes * (1 - mem_fraction_static)
    budget = int(free_bytes - non_static - reserved_bytes - req_to_token_bytes)
    fit_tokens = max(budget, 0) // bytes_per_token
    fit_pages = max(fit_tokens // page_size - 1, 0)  # one page of the budget goes to the padding page

    caps = _caps(
        fit_pages,
        mem_fraction_static,
        bytes_per_token,
        page_size,
        context_length,
        table_rows,
        max_running_requests is None,
        max_total_tokens,
        default_kv_bytes,
    )
    num_pages, winner = min(caps, key=lambda cap: cap[0])  # on a tie the first: the user's cap before memory
    num_tokens = num_pages * page_size
    if max_total_tokens is not None and max_total_tokens // page_size > fit_pages:
        winner += f" (--max-total-tokens {max_total_tokens} does not fit, using what fits)"
    running_note = ""
    if max_running_requests is None:
        request_tokens = -(-context_length // page_size) * page_size  # a request of the context length, in pages
        max_running_requests = default_max_running_requests(num_tokens, request_tokens)
        low, high = DEFAULT_RUNNING_REQUESTS
        running_note = (
            f"; at most {max_running_requests} running requests (no --max-running-requests: "
            f"{DEFAULT_TOKENS_PER_REQUEST} tokens each, within {low}..{high}, enough to fill the pool)"
        )

    explanation = (
        f"KV pool: free {_size(free_bytes)} - total {_size(total_bytes)} x (1 - mem_fraction_static "
        f"{mem_fraction_static:g}) - reserved {_size(reserved_bytes)} - req_to_token {_size(req_to_token_bytes)} "
        f"({table_rows} x {context_length} x 4 B) = budget {_size(budget)}; "
        f"{bytes_per_token} B/token -> {fit_tokens} tokens = {fit_pages} pages of {page_size} + 1 padding page; "
        f"caps in pages: {', '.join(f'{name}: {pages}' for pages, name in caps)}; "
        f"pool {num_tokens} tokens in {num_pages} pages, capped by {winner}{running_note}"
    )

    if num_tokens < context_length:
        fixes = f"raise --mem-fraction-static (now {mem_fraction_static:g}), lower --context-length"
        if max_total_tokens is not None and num_pages < fit_pages:
            fixes = f"raise --max-total-tokens (now {max_total_tokens}), " + fixes
        raise KVPoolTooSmallError(
            f"the KV pool holds {num_tokens} tokens, fewer than --context-length {context_length} "
            f"(budget {_size(budget)} at {bytes_per_token} B/token): {fixes}"
        )

    kv_bytes = (num_pages + 1) * page_size * bytes_per_token
    return KVPoolPlan(
        num_pages=num_pages,
        page_size=page_size,
        num_tokens=num_tokens,
        max_running_requests=max_running_requests,
        req_to_token_bytes=req_to_token_bytes,
        kv_bytes=kv_bytes,
        explanation=explanation,
    )
