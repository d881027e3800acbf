"""Tensor-parallel weight checks, updates and reads, in process: a fake communicator of world size 2 answers for the
other rank, so the fast suite (and the mutation run, which cannot see spawned processes) checks what
tests/test_tp_weights.py checks across real processes: a problem on one rank is raised naming that rank, the same
reason on every rank is said once, a failure on the other rank rolls this rank back bit for bit, and read_weight
puts every rank's block in rank order."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from omnirun.errors import WeightUpdateError
from omnirun.layers.sharding import ShardTarget, Slice
from omnirun.weights import agree, apply_update, check_update, read_weight, refuse_unless_agreed


class FakeComm:
    """World size 2 (or more): this process plays `rank`; `peers` are what the other ranks contribute, in the order
    of the calls (objects for all_gather_object, tensors for all_gather). Records what this rank sent."""

    def __init__(self, rank: int, peers: dict[int, list[Any]], world_size: int = 2):
        self.rank, self.world_size = rank, world_size
        self.peers = {r: list(answers) for r, answers in peers.items()}
        self.sent: list[Any] = []

    def _everyone(self, mine: Any) -> list[Any]:
        self.sent.append(mine)
        return [mine if r == self.rank else self.peers[r].pop(0) for r in range(self.world_size)]

    def all_gather_object(self, obj: Any) -> list[Any]:
        return self._everyone(obj)

    def all_gather(self, tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
        return torch.cat(self._everyone(tensor.clone()), dim=dim)


class FakeModel:
    """A checkpoint model of named ShardTargets."""

    def __init__(self, targets: dict[str, ShardTarget | None]):
        self.targets = targets

    def checkpoint_target(self, name: str) -> ShardTarget | None:
        return self.targets[name]

    def checkpoint_names(self) -> list[str]:
        return [n for n, t in self.targets.items() if t is not None]


def _two_weights() -> tuple[FakeModel, torch.Tensor, torch.Tensor]:
    a = torch.tensor([1.5, -0.0, float("nan"), 3.0])
    b = torch.tensor([[0.25, -7.0], [1e-30, 2.0]])
    model = FakeModel({"a": ShardTarget(a, (4,)), "b": ShardTarget(b, (2, 2))})
    return model, a, b


# --- agree / refuse_unless_agreed / check_update -------------------------------------------------------------------


def test_agree_maps_each_failing_rank_to_its_reason_in_rank_order():
    comm = FakeComm(rank=1, peers={0: ["zero's reason"]})
    assert agree(comm, None) == {0: "zero's reason"}
    assert comm.sent == [None]
    comm = FakeComm(rank=0, peers={1: [None]})
    assert agree(comm, "mine") == {0: "mine"}
    comm = FakeComm(rank=0, peers={1: ["theirs"]})
    assert agree(comm, "mine") == {0: "mine", 1: "theirs"}
    assert agree(None, None) == {} and agree(None, "alone") == {0: "alone"}


def test_a_problem_on_the_other_rank_only_is_raised_here_naming_that_rank():
    model, _, _ = _two_weights()
    comm = FakeComm(rank=0, peers={1: ["tensor 'c' is not a parameter of this model"]})
    with pytest.raises(WeightUpdateError) as info:
        check_update(model, {"a": (4,), "b": (2, 2)}, complete=True, comm=comm)
    assert (
        str(info.value) == "weight update refused, nothing changed: rank 1: tensor 'c' is not a parameter of this model"
    )
    assert comm.sent == [None]  # this rank found nothing wrong and said so


def test_a_problem_on_this_rank_only_is_raised_naming_this_rank():
    model, _, _ = _two_weights()
    comm = FakeComm(rank=1, peers={0: [None]})
    with pytest.raises(WeightUpdateError) as info:
        check_update(model, {"a": (5,)}, complete=False, comm=comm)
    reason = "tensor 'a' has shape [5], the model expects [4]"
    assert str(info.value) == f"weight update refused, nothing changed: rank 1: {reason}"
    assert comm.sent == [reason]


def test_the_same_reason_on_every_rank_is_said_once():
    model, _, _ = _two_weights()
    reason = "the checkpoint lacks 1 tensors, e.g. ['b']"
    comm = FakeComm(rank=0, peers={1: [reason]})
    with pytest.raises(WeightUpdateError) as info:
        check_update(model, {"a": (4,)}, complete=True, comm=comm)
    assert str(info.value) == f"weight update refused, nothing changed: {reason}"


def test_different_reasons_are_each_said_with_their_rank_in_rank_order():
    comm = FakeComm(rank=1, peers={0: ["zzz first rank"]})
    with pytest.raises(WeightUpdateError) as info:
        refuse_unless_agreed(comm, "aaa second rank")
    assert str(info.value) == "weight update refused, nothing changed: rank 0: zzz first rank; rank 1: aaa second rank"


def test_the_same_reason_on_two_of_three_ranks_names_each_rank():
    # two of three ranks fail for the same reason: not every rank, so each is named
    comm = FakeComm(rank=0, peers={1: [None], 2: ["bad"]}, world_size=3)
    with pytest.raises(WeightUpdateError) as info:
        refuse_unless_agreed(comm, "bad")
    assert str(info.value) == "weight update refused, nothing changed: rank 0: bad; rank 2: bad"


def test_no_problem_on_any_rank_refuses_nothing():
    model, _, _ = _two_weights()
    comm = FakeComm(rank=1, peers={0: [None]})
    check_update(model, {"a": (4,), "b": (2, 2)}, complete=True, comm=comm)
    assert comm.sent == [None]


# --- apply_update ---------------------------------------------------------------------------------------------------


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32).clone()


def test_a_failure_on_the_other_rank_rolls_this_rank_back_bit_for_bit():
    model, a, b = _two_weights()
    old_a, old_b = _bits(a), _bits(b)
    comm = FakeComm(rank=0, peers={1: ["RuntimeError: CUDA out of memory"]})
    new = [("a", torch.tensor([9.0, 8.0, 7.0, 6.0])), ("b", torch.full((2, 2), 5.0))]
    with pytest.raises(WeightUpdateError) as info:
        apply_update(model, new, comm=comm)
    assert torch.equal(_bits(a), old_a) and torch.equal(_bits(b), old_b)  # -0.0, nan and the denormal kept exactly
    assert comm.sent == [None]  # this rank copied both and reported no failure
    assert str(info.value) == (
        "weight update failed on rank(s) 1 and was rolled back on every rank (2 tensors restored here): "
        "rank 1: RuntimeError: CUDA out of memory"
    )


def test_a_failure_on_this_rank_is_reported_with_its_rank_and_its_first_line():
    model, a, b = _two_weights()
    old_a = _bits(a)

    class Exploding:
        shape, dtype = (2, 2), torch.float32

        def read(self, index):
            raise OSError("disk gone\nsecond line")

    comm = FakeComm(rank=1, peers={0: [None]})
    with pytest.raises(WeightUpdateError) as info:
        apply_update(model, [("a", torch.zeros(4)), ("b", Exploding())], comm=comm)
    assert torch.equal(_bits(a), old_a)
    assert comm.sent == ["OSError: disk gone"]
    assert str(info.value) == (
        "weight update failed on rank(s) 1 and was rolled back on every rank (1 tensors restored here): "
        "rank 1: OSError: disk gone"
    )
    assert isinstance(info.value.__cause__, OSError)


def test_the_same_failure_on_both_ranks_lists_both_and_says_the_reason_once():
    model, _, _ = _two_weights()
    reason = "ValueError: tensor 'b' has shape [3], the model expects [2, 2]"
    comm = FakeComm(rank=0, peers={1: [reason]})
    with pytest.raises(WeightUpdateError) as info:
        apply_update(model, [("a", torch.zeros(4)), ("b", torch.zeros(3))], comm=comm)
    assert str(info.value) == (
        "weight update failed on rank(s) 0, 1 and was rolled back on every rank (1 tensors restored here): " + reason
    )


def test_an_update_without_failures_on_any_rank_keeps_the_new_values():
    model, a, b = _two_weights()
    comm = FakeComm(rank=1, peers={0: [None]})
    assert apply_update(model, [("a", torch.arange(4.0)), ("b", torch.ones(2, 2))], comm=comm) == 2
    assert torch.equal(a, torch.tensor([0.0, 1.0, 2.0, 3.0])) and torch.equal(b, torch.ones(2, 2))


# --- read_weight: gathering every rank's block ---------------------------------------------------------------------


def test_read_weight_gathers_row_blocks_of_different_lengths_in_rank_order():
    # vocabulary 5 over 2 ranks: blocks of 3 rows, rank 1 holds rows 3..4 (one padding row).
    full = torch.tensor([[0.0, 0.5], [1.0, 1.5], [2.0, 2.5], [3.0, 3.5], [4.0, 4.5]])
    mine = torch.tensor([[3.0, 3.5], [4.0, 4.5]])
    rank0_block = torch.tensor([[0.0, 0.5], [1.0, 1.5], [2.0, 2.5]])
    model = FakeModel({"emb": ShardTarget(mine, (5, 2), 0, 3, 2)})
    comm = FakeComm(rank=1, peers={0: [torch.tensor([0, 3]), rank0_block]})
    value = read_weight(model, "emb", comm=comm)
    assert torch.equal(value, full)
    place, padded = comm.sent
    assert place.tolist() == [3, 2] and place.dtype == torch.int64
    assert torch.equal(padded, torch.tensor([[3.0, 3.5], [4.0, 4.5], [0.0, 0.0]]))  # padded to the longest, with 0


def test_read_weight_gathers_column_blocks_for_rank_zero():
    # a row-parallel weight [2, 4]: rank 0 holds columns 0..1, rank 1 columns 2..3
    full = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]])
    mine = full[:, :2].clone()
    model = FakeModel({"o": ShardTarget(mine, (2, 4), 1, 0, 2)})
    comm = FakeComm(rank=0, peers={1: [torch.tensor([2, 2]), torch.tensor([[3.0, 4.0], [7.0, 8.0]])]})
    value = read_weight(model, "o", comm=comm)
    assert torch.equal(value, full)
    value.zero_()
    assert torch.equal(mine, full[:, :2])  # a new tensor, not the parameter


def test_read_weight_puts_overlapping_replicated_blocks_in_place():
    # 2 kv heads of 1 row over 4 ranks: ranks 0 and 1 hold head 0, ranks 2 and 3 head 1
    full = torch.tensor([[10.0, 11.0], [20.0, 21.0]])
    model = FakeModel({"k": ShardTarget(full[1:].clone(), (2, 2), 0, 1, 1)})
    peers = {
        0: [torch.tensor([0, 1]), full[:1].clone()],
        1: [torch.tensor([0, 1]), full[:1].clone()],
        3: [torch.tensor([1, 1]), full[1:].clone()],
    }
    value = read_weight(model, "k", comm=FakeComm(rank=2, peers=peers, world_size=4))
    assert torch.equal(value, full)


def test_read_weight_does_not_gather_a_replicated_tensor_or_a_world_of_one():
    norm = torch.tensor([1.0, 2.0])
    block = torch.tensor([[1.0, 2.0]])
    model = FakeModel({"norm": ShardTarget(norm, (2,)), "emb": ShardTarget(block, (2, 2), 0, 0, 1)})
    comm = FakeComm(rank=0, peers={1: []})
    assert torch.equal(read_weight(model, "norm", comm=comm), norm) and comm.sent == []
    solo = FakeComm(rank=0, peers={}, world_size=1)
    assert torch.equal(read_weight(model, "emb", comm=solo), block) and solo.sent == []
    assert torch.equal(read_weight(model, "emb"), block)


# --- Linear.extra_repr, sharding, vocabulary blocks ------------------------------------------------------------------


def test_linear_extra_repr_names_sizes_bias_and_shards():
    from omnirun.layers.linear import Linear
    from omnirun.layers.ops import Ops

    plain = Linear(3, 5, bias=False, ops=Ops(), dtype=torch.float32)
    assert plain.extra_repr() == "in=3, out=5, bias=False"
    fused = Linear(3, {"q": 4, "k": 2, "v": 2}, bias=True, ops=Ops(), dtype=torch.float32)
    assert fused.extra_repr() == "in=3, out=8, bias=True, shards=(q=4, k=2, v=2)"
    split = Linear(3, {"gate": Slice(8, 4, 4), "up": Slice(8, 4, 4)}, bias=False, ops=Ops(), dtype=torch.float32)
    assert split.extra_repr() == "in=3, out=8, bias=False, shards=(gate=4, up=4)"
    row = Linear(Slice(6, 3, 3), 5, bias=True, ops=Ops(), dtype=torch.float32)
    assert row.extra_repr() == "in=3, out=5, bias=True"


def test_shard_target_of_a_whole_slice_is_unsplit_and_takes_everything():
    full = torch.arange(12.0).view(3, 4)
    target = ShardTarget.of(full, (3, 4), 1, Slice.whole(4))
    assert (target.dim, target.start, target.length, target.full_shape) == (None, 0, 0, (3, 4))
    assert target.index is None
    assert target.take(full) is full


def test_shard_target_of_a_block_reads_and_takes_only_that_block():
    full = torch.arange(12.0).view(3, 4)
    target = ShardTarget.of(torch.empty(3, 2), [3, 4], 1, Slice(4, 1, 2))
    assert (target.dim, target.start, target.length, target.full_shape) == (1, 1, 2, (3, 4))
    assert target.index == (slice(None), slice(1, 3))
    part = target.take(full)
    assert torch.equal(part, torch.tensor([[1.0, 2.0], [5.0, 6.0], [9.0, 10.0]]))
    assert part.data_ptr() == full.data_ptr() + 1 * full.element_size()  # a view
    rows = ShardTarget.of(torch.empty(1, 4), (3, 4), 0, Slice(3, 2, 1))
    assert rows.index == (slice(2, 3),)
    assert torch.equal(rows.take(full), torch.tensor([[8.0, 9.0, 10.0, 11.0]]))


def test_a_slice_is_whole_only_from_zero_to_the_end():
    assert Slice.whole(5) == Slice(full=5, start=0, size=5) and Slice.whole(5).is_whole
    assert not Slice(5, 0, 4).is_whole
    assert not Slice(5, 1, 4).is_whole
    assert not Slice(5, 1, 5).is_whole


def _tp(rank: int, size: int, comm: Any):
    from omnirun.distributed.tensor_parallel import TensorParallel

    return TensorParallel(rank=rank, size=size, comm=comm)


@pytest.mark.parametrize(
    ("vocab", "size", "rank", "rows", "block"),
    [
        (5, 2, 0, 3, Slice(5, 0, 3)),
        (5, 2, 1, 3, Slice(5, 3, 2)),
        (5, 4, 2, 2, Slice(5, 4, 1)),
        (5, 4, 3, 2, Slice(5, 5, 0)),  # wholly padding
        (6, 3, 2, 2, Slice(6, 4, 2)),
    ],
)
def test_vocab_blocks_are_padded_to_equal_sizes(vocab, size, rank, rows, block):
    from omnirun.layers.embedding import _vocab_block

    assert _vocab_block(vocab, _tp(rank, size, None)) == (rows, block)


def test_vocab_padding_rows_are_zero_and_never_a_checkpoint_target(monkeypatch):
    from omnirun.layers.embedding import VocabEmbedding

    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: empty(*a, **k).fill_(float("nan")))  # garbage, not zeros
    emb = VocabEmbedding(5, 2, dtype=torch.float32, tp=_tp(1, 2, FakeComm(1, {})))
    monkeypatch.undo()
    assert emb.weight.shape == (3, 2)
    assert torch.equal(emb.weight[2], torch.zeros(2))
    assert torch.isnan(emb.weight[:2]).all()  # the real rows wait for the checkpoint
    target = emb.checkpoint_slice()
    assert (target.full_shape, target.dim, target.start, target.length) == ((5, 2), 0, 3, 2)
    assert target.view.data_ptr() == emb.weight.data_ptr() and target.view.shape == (2, 2)


def test_parallel_embedding_zeroes_the_ids_of_other_blocks_before_the_sum():
    from omnirun.layers.embedding import VocabEmbedding

    class Summing:
        world_size, rank = 2, 1

        def all_reduce(self, t):
            self.seen = t.clone()
            return t

    comm = Summing()
    emb = VocabEmbedding(5, 2, dtype=torch.float32, tp=_tp(1, 2, comm))
    emb.weight.data.copy_(torch.tensor([[3.0, 3.5], [4.0, 4.5], [0.0, 0.0]]))
    out = emb(torch.tensor([0, 3, 2, 4, 5]))  # 5: past the vocabulary, in this rank's padding row
    assert torch.equal(out, torch.tensor([[0.0, 0.0], [3.0, 3.5], [0.0, 0.0], [4.0, 4.5], [0.0, 0.0]]))


def test_parallel_lm_head_joins_blocks_in_rank_order_and_drops_padding_logits():
    from omnirun.layers.embedding import LMHead
    from omnirun.layers.ops import Ops

    rank0_logits = torch.tensor([[10.0, 11.0, 12.0]])
    comm = FakeComm(rank=1, peers={0: [rank0_logits]})
    head = LMHead(5, 2, ops=Ops(), dtype=torch.float32, tied_to=None, tp=_tp(1, 2, comm))
    head.weight.data.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]]))
    assert head.padded
    logits = head(torch.tensor([[13.0, 14.0]]))
    assert torch.equal(logits, torch.tensor([[10.0, 11.0, 12.0, 13.0, 14.0]]))
    assert logits.is_contiguous()


def test_linear_parameters_are_frozen_in_the_asked_dtype_and_one_split_only():
    from omnirun.layers.linear import Linear
    from omnirun.layers.ops import Ops

    layer = Linear(3, 4, bias=True, ops=Ops(), dtype=torch.float16)
    assert layer.prepared is None
    for p in (layer.weight, layer.bias):
        assert p.dtype == torch.float16 and not p.requires_grad
    assert layer.weight.shape == (4, 3) and layer.bias.shape == (4,)
    with pytest.raises(ValueError, match=r"^a linear layer splits its input or its output over the ranks, not both$"):
        Linear(Slice(6, 3, 3), Slice(4, 0, 2), bias=False, ops=Ops(), dtype=torch.float32)


def test_linear_checkpoint_slices_of_column_and_row_parallel_layers():
    from omnirun.layers.linear import Linear
    from omnirun.layers.ops import Ops

    col = Linear(3, {"q": Slice(8, 4, 4), "k": Slice(2, 0, 1)}, bias=True, ops=Ops(), dtype=torch.float32)
    w, b = col.checkpoint_slice("weight", "k"), col.checkpoint_slice("bias", "q")
    assert (w.full_shape, w.dim, w.start, w.length) == ((2, 3), 0, 0, 1)
    assert w.view.data_ptr() == col.weight.data_ptr() + 4 * 3 * 4  # after q's 4 rows of 3 floats
    assert (b.full_shape, b.dim, b.start, b.length) == ((8,), 0, 4, 4)
    row = Linear(Slice(6, 3, 3), 5, bias=True, ops=Ops(), dtype=torch.float32)
    w, b = row.checkpoint_slice("weight"), row.checkpoint_slice("bias")
    assert (w.full_shape, w.dim, w.start, w.length) == ((5, 6), 1, 3, 3) and w.view.shape == (5, 3)
    assert w.view.data_ptr() == row.weight.data_ptr()
    assert (b.full_shape, b.dim) == ((5,), None) and b.view.data_ptr() == row.bias.data_ptr()


@pytest.mark.parametrize(("rank", "size"), [(0, 2), (1, 2), (0, 1)])
def test_row_parallel_linear_adds_its_bias_once_and_sums_the_ranks(rank, size):
    from omnirun.layers.linear import RowParallelLinear
    from omnirun.layers.ops import Ops

    other = torch.tensor([[100.0, 200.0]])  # the other rank's partial product

    class Summing:
        world_size = size
        calls = 0

        def all_reduce(self, t):
            Summing.calls += 1
            return t.add_(other)

    layer = RowParallelLinear(
        Slice(4, 2 * rank, 2), 2, bias=True, ops=Ops(), dtype=torch.float32, tp=_tp(rank, size, Summing())
    )
    layer.weight.data.copy_(torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
    layer.bias.data.copy_(torch.tensor([0.5, -0.5]))
    out = layer(torch.tensor([[1.0, 1.0]]))  # x W^T = [3, 7]
    expected = {(0, 2): [[103.5, 206.5]], (1, 2): [[103.0, 207.0]], (0, 1): [[3.5, 6.5]]}[(rank, size)]
    assert torch.equal(out, torch.tensor(expected))
    assert Summing.calls == (1 if size > 1 else 0)
