"""Start-up of torch.distributed: two "nodes" on one machine, a torchrun launch, a peer that never joins (a clear
error within the timeout, never a hang), and the flag combinations that cannot work."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from omnirun.distributed import init_distributed, plan_world
from omnirun.distributed.world import TORCHRUN_VARS, free_port
from omnirun.errors import DistributedInitError
from omnirun.registry import get_platform

THIS = Path(__file__).resolve()


def _rank_main(mode: str, args: list[str]) -> None:
    """One process: join as `mode` says, all_reduce its rank + 1, print the result (or the one-line error)."""
    if mode == "node":  # argv: node_rank nnodes port timeout
        node_rank, nnodes, port, timeout = int(args[0]), int(args[1]), int(args[2]), float(args[3])
        spec = plan_world(nnodes, node_rank=node_rank, nnodes=nnodes, dist_init_addr=f"127.0.0.1:{port}", environ={})
    else:  # torchrun: everything from the environment it exported
        spec, timeout = plan_world(), 30.0
    platform = get_platform("cpu")
    try:
        init_distributed(platform, spec, timeout_s=timeout, device_index=0)
    except DistributedInitError as exc:
        print(f"ERROR {exc}", flush=True)
        sys.exit(3)
    comm = platform.make_communicator(None)
    total = comm.all_reduce(torch.tensor([float(spec.rank + 1)])).item()
    dist.destroy_process_group()
    # One write per line: torchrun's ranks share one stdout pipe, and print() may write the newline separately.
    sys.stdout.write("RESULT " + json.dumps({"rank": spec.rank, "world_size": comm.world_size, "sum": total}) + "\n")
    sys.stdout.flush()


def _start(*argv: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _finish(proc: subprocess.Popen, timeout: float = 60) -> tuple[str, str]:
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    finally:
        proc.kill()
    return stdout, stderr


def _results(stdout: str) -> list[dict]:
    # Found anywhere in the stream, not per line, so that two ranks' writes running together still parse.
    return [json.loads(found) for found in re.findall(r"RESULT (\{[^{}]*\})", stdout)]


def test_two_nodes_on_one_machine_join_one_world_and_all_reduce():
    port = free_port()
    procs = [_start(str(THIS), "node", str(node), "2", str(port), "30") for node in (0, 1)]
    results = []
    for proc in procs:
        stdout, stderr = _finish(proc)
        assert proc.returncode == 0, stderr[-3000:]
        results += _results(stdout)
    assert sorted((r["rank"], r["world_size"], r["sum"]) for r in results) == [(0, 2, 3.0), (1, 2, 3.0)]


def test_torchrun_launch_uses_its_environment():
    env = {k: v for k, v in __import__("os").environ.items() if k not in TORCHRUN_VARS}
    proc = _start(
        "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
        str(THIS), "torchrun", env=env,
    )  # fmt: skip
    stdout, stderr = _finish(proc)
    assert proc.returncode == 0, stderr[-3000:]
    assert sorted((r["rank"], r["world_size"], r["sum"]) for r in _results(stdout)) == [(0, 2, 3.0), (1, 2, 3.0)]
    # torchrun's agent already listens at MASTER_PORT: rank 0 must join it as a client, not try (and fail) to bind.
    assert "failed to bind" not in stderr


def test_a_peer_that_never_joins_is_one_clear_error_within_the_timeout():
    # Only rank 0 of 2 starts, and (another world) only rank 1 of 2: both must give up in time and say why.
    port0, port1 = free_port(), free_port()
    started = time.monotonic()
    alone0 = _start(str(THIS), "node", "0", "2", str(port0), "5")
    alone1 = _start(str(THIS), "node", "1", "2", str(port1), "3")
    (out0, err0), (out1, err1) = _finish(alone0, timeout=60), _finish(alone1, timeout=60)
    elapsed = time.monotonic() - started
    assert (alone0.returncode, alone1.returncode) == (3, 3), err0[-2000:] + err1[-2000:]
    [line0] = [line for line in out0.splitlines() if line.startswith("ERROR ")]
    assert f"1 of 2 ranks joined the rendezvous at 127.0.0.1:{port0} within 5 s; missing rank(s) 1:" in line0
    assert "--dist-timeout" in line0
    [line1] = [line for line in out1.splitlines() if line.startswith("ERROR ")]
    assert f"rank 1 could not reach the rendezvous at 127.0.0.1:{port1} within 3 s" in line1
    assert elapsed < 40  # the 5 s deadline plus two interpreters starting torch on a busy machine, not a hang


@pytest.mark.parametrize(
    "kwargs, environ, message",
    [
        ({"world_size": 2, "nnodes": 2, "node_rank": 2, "dist_init_addr": "h:1"}, {}, "--node-rank 2 is out of range"),
        ({"world_size": 2, "nnodes": 2, "node_rank": -1, "dist_init_addr": "h:1"}, {}, "--node-rank -1 is out of"),
        ({"world_size": 3, "nnodes": 2, "dist_init_addr": "h:1"}, {}, "does not split evenly over --nnodes 2"),
        ({"world_size": 2, "nnodes": 2}, {}, "--nnodes 2 needs --dist-init-addr HOST:PORT"),
        ({"world_size": 2, "nnodes": 0}, {}, "--nnodes 0 is not positive"),
        ({"world_size": 2, "local_rank": 2}, {}, "local rank 2 is out of range for 2 rank(s) per node"),
        ({"dist_init_addr": "10.0.0.1"}, {}, "is not HOST:PORT"),
        ({"dist_init_addr": "10.0.0.1:port"}, {}, "is not HOST:PORT"),
        ({"dist_init_addr": ":29500"}, {}, "is not HOST:PORT"),
        ({"dist_init_addr": "10.0.0.1:70000"}, {}, "is not HOST:PORT"),
        ({}, {"RANK": "0", "WORLD_SIZE": "2"}, "missing LOCAL_RANK, MASTER_ADDR, MASTER_PORT"),
        (
            {"world_size": 4},
            {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "h", "MASTER_PORT": "1"},
            "differs from torchrun's WORLD_SIZE=2",
        ),  # fmt: skip
        (
            {"nnodes": 2},
            {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "h", "MASTER_PORT": "1"},
            "drop the flags",
        ),  # fmt: skip
        (
            {},
            {"RANK": "x", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "h", "MASTER_PORT": "1"},
            "not integers",
        ),  # fmt: skip
    ],
)
def test_bad_combinations_are_one_line_errors_naming_the_fix(kwargs, environ, message):
    with pytest.raises(DistributedInitError) as caught:
        plan_world(**kwargs, environ=environ)
    text = str(caught.value)
    assert message in text and "\n" not in text and ": " in text


def test_ranks_are_numbered_node_by_node():
    spec = plan_world(8, local_rank=1, nnodes=2, node_rank=1, dist_init_addr="[::1]:29500", environ={})
    assert (spec.rank, spec.world_size, spec.ranks_per_node, spec.init_method) == (5, 8, 4, "tcp://[::1]:29500")
    assert (spec.for_local_rank(3).rank, spec.for_local_rank(3).local_rank) == (7, 3)
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "n0", "MASTER_PORT": "29400"}
    spec = plan_world(environ={**env, "LOCAL_WORLD_SIZE": "2"})
    assert (spec.rank, spec.world_size, spec.local_rank, spec.nnodes, spec.init_method) == (3, 4, 1, 2, "env://")
    one = plan_world(environ={})
    assert (one.rank, one.world_size, one.host) == (0, 1, "127.0.0.1") and 0 < one.port < 2**16


@pytest.fixture
def no_process_group():
    """These checks run in this process: leave the world-of-one group an earlier runner joined (it stays joined
    until exit), so that start-up reaches what is checked instead of refusing a second initialisation."""
    if dist.is_initialized():
        dist.destroy_process_group()


def test_a_port_already_taken_is_one_clear_error_naming_the_address(no_process_group):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        spec = plan_world(2, dist_init_addr=f"127.0.0.1:{port}", environ={})
        started = time.monotonic()
        expected = rf"rank 0 could not listen at 127.0.0.1:{port} .*pick a free port"
        with pytest.raises(DistributedInitError, match=expected):
            init_distributed(get_platform("cpu"), spec, timeout_s=5, device_index=0)
    assert time.monotonic() - started < 5 and not (dist.is_initialized() and dist.get_world_size() == 2)


def test_a_rank_without_its_own_device_is_an_error_before_any_socket_opens(no_process_group):
    # One device per rank by default: a second local rank on the one-device CPU must say so, not bind a port.
    spec = plan_world(2, local_rank=1, dist_init_addr="127.0.0.1:1", environ={})
    with pytest.raises(DistributedInitError, match=r"rank 1 needs cpu device 1 but this node has 1: run at most 1"):
        init_distributed(get_platform("cpu"), spec, timeout_s=1)
    assert not dist.is_initialized() or dist.get_world_size() == 1


if __name__ == "__main__":
    _rank_main(sys.argv[1], sys.argv[2:])
