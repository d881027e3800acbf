"""The communicator the platform builds, over gloo: every collective gives the right values on every rank (2 and 4
processes on this machine stand in for devices), and a world of one makes no torch.distributed call at all."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from omnirun.distributed import Communicator, init_process_group
from omnirun.distributed.world import free_port
from omnirun.registry import get_platform

THIS = Path(__file__).resolve()


def _rank_main(rank: int, world_size: int, port: int, flag_file: str) -> None:
    """One rank: join, run every collective, print what it saw as JSON (the test asserts in the parent)."""
    from omnirun.distributed import init_distributed, plan_world

    platform = get_platform("cpu")
    spec = plan_world(world_size, local_rank=rank, dist_init_addr=f"127.0.0.1:{port}")
    init_distributed(platform, spec, timeout_s=30, device_index=0)  # CPU ranks share device 0
    comm = platform.make_communicator(None)
    seen: dict = {"rank": comm.rank, "world_size": comm.world_size, "type": type(comm).__name__}

    seen["all_reduce"] = comm.all_reduce(torch.full((2, 3), float(rank + 1))).tolist()
    seen["all_gather_0"] = comm.all_gather(torch.tensor([[rank, 10 * rank]])).tolist()
    seen["all_gather_1"] = comm.all_gather(torch.tensor([[rank], [rank + 100]]), dim=1).tolist()
    out = torch.empty(2, world_size)
    seen["all_gather_out"] = comm.all_gather(torch.tensor([[float(rank)], [-rank]]), dim=-1, out=out).tolist()
    seen["all_gather_out_is_out"] = comm.all_gather(torch.tensor([[float(rank)], [-rank]]), dim=-1, out=out) is out
    seen["broadcast"] = comm.broadcast(torch.full((3,), float(rank)), src=world_size - 1).tolist()
    seen["broadcast_object"] = comm.broadcast_object({"from": rank, "items": [rank, "x"]} if rank == 1 else None, src=1)

    # barrier: rank 0 arrives late and writes a file just before; nobody may pass the barrier before it exists.
    if rank == 0:
        time.sleep(0.5)
        Path(flag_file).write_text("here")
    comm.barrier()
    seen["after_barrier_flag"] = Path(flag_file).exists()

    if world_size == 4:  # a subgroup: src is the rank within the group, sums stay inside it
        sub = dist.new_group([2, 3])
        if rank in (2, 3):
            sub_comm = platform.make_communicator(sub)
            seen["sub_rank"] = sub_comm.rank
            seen["sub_all_reduce"] = sub_comm.all_reduce(torch.tensor([float(rank)])).tolist()
            seen["sub_broadcast"] = sub_comm.broadcast(torch.tensor([float(rank)]), src=1).tolist()
    dist.destroy_process_group()
    print("RESULT " + json.dumps(seen), flush=True)


def _run_world(world_size: int, tmp_path: Path) -> list[dict]:
    port = free_port()
    flag = str(tmp_path / "rank0-arrived")
    procs = [
        subprocess.Popen(
            [sys.executable, str(THIS), str(rank), str(world_size), str(port), flag],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(world_size)
    ]
    results = []
    try:
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=60)
            assert proc.returncode == 0, stderr[-3000:]
            results.append(json.loads(stdout.split("RESULT ", 1)[1]))
    finally:
        for proc in procs:
            proc.kill()
    return results


@pytest.mark.parametrize("world_size", [2, 4])
def test_collectives_give_the_right_values_on_every_rank(world_size, tmp_path):
    results = _run_world(world_size, tmp_path)
    n = world_size
    total = float(sum(range(1, n + 1)))
    for rank, seen in enumerate(results):
        assert (seen["rank"], seen["world_size"], seen["type"]) == (rank, n, "Communicator")
        assert seen["all_reduce"] == [[total] * 3] * 2
        assert seen["all_gather_0"] == [[r, 10 * r] for r in range(n)]
        assert seen["all_gather_1"] == [list(range(n)), [r + 100 for r in range(n)]]
        assert seen["all_gather_out"] == [[float(r) for r in range(n)], [float(-r) for r in range(n)]]
        assert seen["all_gather_out_is_out"] is True
        assert seen["broadcast"] == [float(n - 1)] * 3
        assert seen["broadcast_object"] == {"from": 1, "items": [1, "x"]}
        assert seen["after_barrier_flag"] is True
    if world_size == 4:
        assert [results[r]["sub_rank"] for r in (2, 3)] == [0, 1]
        assert [results[r]["sub_all_reduce"] for r in (2, 3)] == [[5.0], [5.0]]
        assert [results[r]["sub_broadcast"] for r in (2, 3)] == [[3.0], [3.0]]


_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "broadcast_object_list", "barrier")


def _forbid_collectives(monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("a world of one made a torch.distributed collective call")

    for name in _COLLECTIVES:
        monkeypatch.setattr(dist, name, refuse)


def _exercise(comm: Communicator) -> None:
    x = torch.arange(6.0).reshape(2, 3)
    assert comm.all_reduce(x) is x and x.tolist() == [[0, 1, 2], [3, 4, 5]]
    assert comm.all_gather(x, dim=1) is x
    out = torch.empty(2, 3)
    assert comm.all_gather(x, out=out) is out and torch.equal(out, x)
    assert comm.broadcast(x) is x
    obj = {"a": [1]}
    assert comm.broadcast_object(obj) is obj
    comm.barrier()


def test_world_of_one_makes_no_torch_distributed_call_in_a_joined_group(monkeypatch):
    # A launcher's world of one (e.g. torchrun --nproc-per-node 1): the communicator must then be free.
    platform = get_platform("cpu")
    joined_here = not dist.is_initialized()
    if joined_here:
        init_process_group(platform, world_size=1, init_method=f"tcp://127.0.0.1:{free_port()}")
    try:
        comm = platform.make_communicator(None)
        assert comm.world_size == 1
        _forbid_collectives(monkeypatch)
        for name in ("get_world_size", "get_rank"):  # nor any lookup per call
            monkeypatch.setattr(dist, name, lambda *a, **k: pytest.fail("per-call lookup in a world of one"))
        _exercise(comm)
    finally:
        monkeypatch.undo()
        if joined_here:
            dist.destroy_process_group()


def test_world_of_one_makes_no_torch_distributed_call_without_a_group(monkeypatch):
    if dist.is_initialized():
        pytest.skip("a process group is already joined in this process")
    _forbid_collectives(monkeypatch)
    for name in ("get_world_size", "get_rank"):
        monkeypatch.setattr(dist, name, lambda *a, **k: pytest.fail("looked up a group that does not exist"))
    comm = get_platform("cpu").make_communicator(None)
    assert (comm.world_size, comm.rank) == (1, 0)
    _exercise(comm)


if __name__ == "__main__":
    _rank_main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
