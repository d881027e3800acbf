"""How a decoder splits over a tensor-parallel group: heads, MLP columns and vocabulary rows per rank.

Megatron's split: each rank holds whole attention heads (a contiguous block of q heads and the kv heads they read)
and a contiguous block of the MLP's intermediate columns; the vocabulary is split into equal blocks of rows. Sizes
that do not divide are handled thus, and said so in the errors:
- q heads, and the MLP's intermediate size (a mixture's experts' and shared expert's too), must divide by the tp
  size: an error names the sizes that work. With expert parallelism the number of experts must divide instead,
  each rank holding a block of whole experts.
- kv heads fewer than ranks are replicated: each kv head lives on tp_size / num_kv_heads ranks (which must divide).
- the vocabulary is padded up to a multiple of the tp size; padded rows are zeros and their logits are dropped.
"""

from __future__ import annotations

import dataclasses

from omnirun.errors import ConfigError
from omnirun.models.architecture import DecoderShape


@dataclasses.dataclass(frozen=True)
class TPLayout:
    """This rank's share of one model."""

    tp_rank: int
    tp_size: int
    num_heads: int  # q heads on this rank
    head_start: int  # the model's index of this rank's first q head
    num_kv_heads: int  # kv heads on this rank (1 when replicated)
    kv_head_start: int  # the model's index of this rank's first kv head
    vocab_per_rank: int  # rows of the embedding / LM head on each rank (padding included)
    vocab_size: int  # the model's real vocabulary
    # Mixtures of experts: with expert parallelism this rank holds experts [expert_start, expert_start +
    # experts_per_rank) whole; without it every expert, each split by columns.
    expert_parallel: bool = False
    expert_start: int = 0
    experts_per_rank: int = 0

    @property
    def vocab_start(self) -> int:
        return self.tp_rank * self.vocab_per_rank

    @property
    def vocab_rows_real(self) -> int:
        """Rows of this rank's vocabulary block that are real tokens (the rest is padding)."""
        return max(0, min(self.vocab_per_rank, self.vocab_size - self.vocab_start))


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def tp_layout(shape: DecoderShape, tp_size: int, tp_rank: int, expert_parallel: bool = False) -> TPLayout:
    """The split of `shape` for rank `tp_rank` of `tp_size` (`expert_parallel`: whole experts per rank); a
    ConfigError naming the fix when it cannot split."""
    if tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise ConfigError(f"tensor-parallel rank {tp_rank} of {tp_size} is out of range")
    heads, kv_heads = shape.num_heads, shape.num_kv_heads
    if heads % tp_size:
        raise ConfigError(
            f"--tp-size {tp_size} does not divide the model's {heads} attention heads: use one of {_divisors(heads)}"
        )
    if kv_heads >= tp_size and kv_heads % tp_size:
        raise ConfigError(
            f"--tp-size {tp_size} does not divide the model's {kv_heads} kv heads: use one of {_divisors(kv_heads)}, "
            f"or a multiple of {kv_heads} (kv heads are then replicated)"
        )
    if kv_heads < tp_size and tp_size % kv_heads:
        raise ConfigError(
            f"--tp-size {tp_size} is not a multiple of the model's {kv_heads} kv heads, so they cannot be replicated "
            f"evenly: use one of {_divisors(kv_heads)} or a multiple of {kv_heads}"
        )
    moe = shape.moe
    experts = moe.num_experts if moe is not None else 0
    if expert_parallel and not experts:
        raise ConfigError("--enable-expert-parallel needs a mixture-of-experts model: drop the flag for this one")
    if expert_parallel and experts % tp_size:
        raise ConfigError(
            f"--tp-size {tp_size} does not divide the model's {experts} experts, as expert parallelism needs: use one "
            f"of {_divisors(experts)}"
        )
    # The column splits: the dense MLP's where a layer has one, each expert's unless experts stay whole.
    sizes = {}
    if moe is None or not all(moe.sparse_layers):
        sizes["intermediate size"] = shape.intermediate_size
    if moe is not None and not expert_parallel:
        sizes["experts' intermediate size"] = moe.intermediate_size
    if moe is not None and moe.shared_intermediate_size:
        sizes["shared expert's intermediate size"] = moe.shared_intermediate_size
    for what, size in sizes.items():
        if size % tp_size:
            raise ConfigError(
                f"--tp-size {tp_size} does not divide the model's {what} {size}: use one of {_divisors(size)}"
            )
    heads_per_rank = heads // tp_size
    return TPLayout(
        tp_rank=tp_rank,
        tp_size=tp_size,
        num_heads=heads_per_rank,
        head_start=tp_rank * heads_per_rank,
        num_kv_heads=max(1, kv_heads // tp_size),
        kv_head_start=tp_rank * kv_heads // tp_size,
        vocab_per_rank=-(-shape.vocab_size // tp_size),
        vocab_size=shape.vocab_size,
        expert_parallel=expert_parallel,
        expert_start=tp_rank * experts // tp_size if expert_parallel else 0,
        experts_per_rank=experts // tp_size if expert_parallel else experts,
    )
