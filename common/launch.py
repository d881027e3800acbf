"""Starting the runner of this process: one device, or one rank of a tensor-parallel group.

`--tp-size N` on one node: this process is rank 0 and spawns ranks 1..N-1. Several nodes (`--nnodes`,
`--node-rank`, `--dist-init-addr`): each node's process spawns that node's other ranks. Under torchrun every rank
is already a process. In every case all ranks then meet (torch.distributed's TCPStore rendezvous), build the same
model split over the group, and agree on the KV pool; rank 0 gets a ModelRunner that sends every step to the
others, and every other rank serves rank 0 until it closes (`serve`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys

import torch.distributed as dist

from omnirun.config import RunnerConfig
from omnirun.distributed import init_distributed, plan_world
from omnirun.distributed.control import ControlChannel
from omnirun.distributed.link import WorkerLink
from omnirun.distributed.local_workers import LocalWorkers
from omnirun.distributed.process_group import control_group, rendezvous_store
from omnirun.distributed.world import WorldSpec
from omnirun.errors import OmnirunError
from omnirun.loader import load_model_config
from omnirun.models.architecture import decoder_shape
from omnirun.models.tp_layout import tp_layout
from omnirun.platform import Platform
from omnirun.registry import select_platform
from omnirun.runner import ModelRunner

logger = logging.getLogger(__name__)


def start_runner(config: RunnerConfig, platform: Platform | None = None) -> ModelRunner:
    """This process's ModelRunner. On a rank other than 0 (torchrun, or a node other than the first) this serves
    rank 0 until it closes and then raises SystemExit(0): only rank 0 returns."""
    if not config.distributed:
        return ModelRunner(config, platform)
    platform = platform if platform is not None else select_platform(config.device)  # library callers
    platform.require_available()
    # What can be checked from the flags and config.json is checked before any process starts.
    tp_layout(decoder_shape(load_model_config(config.model, config.load_format)), config.tp_size, 0)
    spec = plan_world(
        config.tp_size, nnodes=config.nnodes, node_rank=config.node_rank, dist_init_addr=config.dist_init_addr
    )
    local = None
    if not spec.from_torchrun and spec.ranks_per_node > 1:
        others = [spec.for_local_rank(i) for i in range(1, spec.ranks_per_node)]
        local = LocalWorkers(_worker_main, [(other.rank, (config, other)) for other in others])
    try:
        runner, channel = _join_and_build(config, spec, platform, local)
    except BaseException:
        if local is not None:
            local.wait_for_exit(0.0)  # each would wait forever for a rank 0 that is not coming
        raise
    if spec.rank == 0:
        return runner
    _serve_until_shutdown(runner, channel)
    raise SystemExit(0)


def _join_and_build(
    config: RunnerConfig, spec: WorldSpec, platform: Platform, local: LocalWorkers | None
) -> tuple[ModelRunner, ControlChannel]:
    index = platform.bind_rank(spec.local_rank, spec.ranks_per_node)
    link = None

    def peers_alive() -> None:
        if link is not None:
            link.check_alive()
        elif local is not None and local.dead():
            raise OmnirunError(f"rank(s) {sorted(local.dead())} exited before the group formed: see their errors above")

    channel = None
    try:
        init_distributed(platform, spec, timeout_s=config.dist_timeout, device_index=index, peers_alive=peers_alive)
        channel = ControlChannel(control_group(), rendezvous_store())
        if spec.rank == 0:
            link = WorkerLink(channel, local)
        runner = ModelRunner(dataclasses.replace(config, device_index=index), platform)
    except BaseException as exc:
        failure = exc
        if link is not None:
            worker_error = link.fail(exc)  # and stops the local workers
            if not isinstance(exc, OmnirunError):
                failure = worker_error  # rank 0 sees a worker's failure as a broken collective: name the worker
        elif channel is not None:
            channel.report_failure(exc)
        if dist.is_initialized():
            dist.destroy_process_group()
        platform.unbind_rank()
        if failure is exc:
            raise
        raise failure from exc
    runner.own_process_group(link)
    return runner, channel


def serve(runner: ModelRunner, channel: ControlChannel) -> None:
    """A rank other than 0: run rank 0's commands in order until it says shut down. An error every rank agreed on
    (an OmnirunError, e.g. a refused weight update) is rank 0's to report; any other ends this rank."""
    while True:
        kind, payload = channel.receive()
        if kind == "shutdown":
            return
        if kind == "step":
            runner.run_step(payload)
        elif kind == "call":
            method, args, kwargs = payload
            try:
                getattr(runner, method)(*args, **kwargs)
            except OmnirunError as exc:
                logger.info("rank %d: %s failed on every rank: %s", channel.rank, method, exc)
        else:
            raise RuntimeError(f"unknown command {kind!r} from rank 0")


def _serve_until_shutdown(runner: ModelRunner, channel: ControlChannel) -> None:
    try:
        serve(runner, channel)
    except BaseException as exc:
        channel.report_failure(exc)
        raise
    finally:
        runner.close()


def _worker_main(config: RunnerConfig, spec: WorldSpec) -> None:
    """A spawned rank: join, build its runner, serve; a failure is reported to rank 0 and ends the process."""
    logging.basicConfig(level=logging.WARNING, format=f"omnirun rank {spec.rank}: %(levelname)s: %(message)s")
    config = dataclasses.replace(config, progress=False)
    try:
        platform = select_platform(config.device)
        runner, channel = _join_and_build(config, spec, platform, None)
        _serve_until_shutdown(runner, channel)
    except BaseException as exc:
        print(f"omnirun rank {spec.rank}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        os._exit(1)
    os._exit(0)  # skip interpreter teardown: the group is left, nothing of ours is pending
