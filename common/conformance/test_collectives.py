"""Collectives at world size 2 on the device under test: two processes join a group on the platform's backend and
the communicator the platform builds all-reduces, all-gathers and broadcasts correctly on both."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from omnirun.distributed.world import free_port

_RANK = textwrap.dedent(
    """
    import json, sys
    import torch
    from omnirun.distributed import init_distributed, plan_world
    from omnirun.registry import get_platform

    device, rank, port, shared = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "shared"
    platform = get_platform(device)
    spec = plan_world(2, local_rank=rank, dist_init_addr=f"127.0.0.1:{port}")
    init_distributed(platform, spec, timeout_s=60, device_index=0 if shared else rank)
    comm = platform.make_communicator(None)
    on = platform.device(0 if shared else rank)
    seen = {
        "all_reduce": comm.all_reduce(torch.full((4,), float(rank + 1), device=on)).tolist(),
        "all_gather": comm.all_gather(torch.tensor([[rank, 10 + rank]], device=on), dim=1).tolist(),
        "broadcast": comm.broadcast(torch.full((2,), float(rank), device=on), src=1).tolist(),
    }
    comm.barrier()
    torch.distributed.destroy_process_group()
    print("RESULT " + json.dumps(seen), flush=True)
    """
)


def test_all_reduce_all_gather_and_broadcast_at_world_size_2(platform, device_name):
    # Two ranks need two devices, except on a backend whose ranks may share one (gloo: the host).
    shared = platform.distributed_backend == "gloo"
    if not shared and platform.device_count() < 2:
        pytest.skip(f"{device_name} shows {platform.device_count()} device(s): two ranks need two")
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _RANK, device_name, str(rank), str(port), "shared" if shared else "own"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    try:
        results = []
        for proc in procs:
            out, err = proc.communicate(timeout=180)
            assert proc.returncode == 0, err[-3000:]
            results.append(json.loads(out.split("RESULT ", 1)[1]))
    finally:
        for proc in procs:
            proc.kill()
    for seen in results:
        assert seen["all_reduce"] == [3.0] * 4
        assert seen["all_gather"] == [[0, 10, 1, 11]]
        assert seen["broadcast"] == [1.0, 1.0]
