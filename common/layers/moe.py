"""A mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE): a router picks each token's top-k experts, the op
table's `fused_moe` runs them, and Qwen2-MoE adds a shared expert gated by a sigmoid.

The experts' weights are stacked: `w13` [E, 2I, H] holds each expert's gate and up rows (the checkpoint's
`gate_proj`/`up_proj`, Mixtral's `w1`/`w3`), `w2` [E, H, I] its down projection (`down_proj`, `w2`). Under tensor
parallelism every rank holds every expert's block of I columns; with expert parallelism it holds a block of whole
experts instead, and computes only the slots routed to them. Either way the ranks' partial outputs are summed by an
all-reduce, as the dense MLP's are (the router and the tokens are the same on every rank).
"""

from __future__ import annotations

import torch
from torch import nn

from omnirun.distributed.tensor_parallel import TensorParallel
from omnirun.layers.linear import Linear
from omnirun.layers.ops import Ops
from omnirun.layers.sharding import ShardTarget, Slice


class SparseMoE(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        experts: range,
        top_k: int,
        renormalize: bool,
        columns: Slice,
        *,
        ops: Ops,
        dtype: torch.dtype,
        tp: TensorParallel,
        shared: nn.Module | None = None,
    ):
        super().__init__()
        self.ops, self.top_k, self.renormalize, self.columns = ops, top_k, renormalize, columns
        self.num_experts, self.experts = num_experts, experts  # all of them, and the global ids of this rank's
        self.gate = Linear(hidden_size, num_experts, bias=False, ops=ops, dtype=dtype)  # the router, whole
        size, local = columns.size, len(experts)
        self.w13 = nn.Parameter(torch.empty(local, 2 * size, hidden_size, dtype=dtype), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(local, hidden_size, size, dtype=dtype), requires_grad=False)
        self.comm, self.reduce = tp.comm, tp.size > 1
        self.shared_expert = shared  # an MLP whose down projection does its own all-reduce
        self.shared_expert_gate = Linear(hidden_size, 1, bias=False, ops=ops, dtype=dtype) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x)
        out = self.ops.fused_moe(x, logits, self.w13, self.w2, self.top_k, self.renormalize, self.experts.start)
        if self.reduce:
            out = self.comm.all_reduce(out)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out

    def expert_target(self, expert: int, projection: str) -> ShardTarget | None:
        """Where one expert's checkpoint projection ("gate", "up" or "down") lands on this rank (None: the expert
        lives on another rank)."""
        if expert not in self.experts:
            return None
        expert -= self.experts.start
        size, hidden = self.columns.size, self.w2.shape[1]
        if projection == "down":
            return ShardTarget.of(self.w2.data[expert], (hidden, self.columns.full), 1, self.columns)
        rows = self.w13.data[expert].narrow(0, 0 if projection == "gate" else size, size)
        return ShardTarget.of(rows, (self.columns.full, hidden), 0, self.columns)
