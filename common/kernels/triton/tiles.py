"""Which output tile a GEMM program computes, shared by the Triton GEMMs (batch-invariant, fp8, int4)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def l2_grouped_tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(row tile, column tile) of program_id(0) in an M x N output, walked in groups of GROUP_M row tiles: programs
    that share a block of the weight's rows run next to each other, so a weight tile one reads is still in L2 for
    the next row tile (large batches then read the weights about once)."""
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % group_rows, (pid % per_group) // group_rows
