"""The paged KV cache: page allocator, request-to-token table, K/V buffers, their owner, and pool sizing."""

from __future__ import annotations

from omnirun.memory.kv_cache import PagedKVCache
from omnirun.memory.kv_dtype import resolve_kv_cache_dtype, supported_kv_cache_dtype_names
from omnirun.memory.kv_memory import KVMemory
from omnirun.memory.page_allocator import PageAllocator
from omnirun.memory.req_to_token import ReqToTokenPool
from omnirun.memory.sizing import KVPoolPlan, default_max_running_requests, plan_kv_pool

__all__ = [
    "KVMemory",
    "KVPoolPlan",
    "PageAllocator",
    "PagedKVCache",
    "ReqToTokenPool",
    "default_max_running_requests",
    "plan_kv_pool",
    "resolve_kv_cache_dtype",
    "supported_kv_cache_dtype_names",
]
