"""Meeting the other ranks on torch.distributed's own TCPStore, with a deadline and an error that names who is missing.

torch's tcp:// and env:// rendezvous can only say "1/2 clients joined"; omnirun opens the same TCPStore itself and
has every rank sign in under its own key, so a timeout names the missing ranks. No transport of our own: the store is
torch's, and the process group is built on it afterwards.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

from omnirun.distributed.world import WorldSpec
from omnirun.errors import DistributedInitError

_KEY = "omnirun/joined/{}"


def join(spec: WorldSpec, timeout_s: float, peers_alive: Callable[[], None] | None = None) -> dist.Store:
    """Connect to the rendezvous and wait until every rank of `spec.world_size` has signed in, at most `timeout_s`;
    `peers_alive()`, called about every second meanwhile, raises to stop waiting for peers that died."""
    store = _open_store(spec, timeout_s)
    if store.add(_KEY.format(spec.rank), 1) > 1:
        raise DistributedInitError(
            f"rank {spec.rank} joined the rendezvous at {spec.address} twice: give each process its own rank "
            "(--node-rank per node, a distinct local rank per process)"
        )
    keys = [_KEY.format(r) for r in range(spec.world_size)]
    try:
        _wait(store, keys, timeout_s, peers_alive)
    except dist.DistError:
        missing = [r for r, key in enumerate(keys) if not _present(store, key)]
        if not missing:  # everyone arrived just as the deadline passed
            return store
        shown = ", ".join(map(str, missing[:16])) + (", ..." if len(missing) > 16 else "")
        raise DistributedInitError(
            f"{spec.world_size - len(missing)} of {spec.world_size} ranks joined the rendezvous at {spec.address} "
            f"within {timeout_s:g} s; missing rank(s) {shown}: start them with the same address (each node with its "
            "--node-rank), or raise --dist-timeout"
        ) from None
    return store


def _wait(store: dist.Store, keys: list[str], timeout_s: float, peers_alive: Callable[[], None] | None) -> None:
    if peers_alive is None:
        store.wait(keys, timedelta(seconds=timeout_s))
        return
    # Poll (store.wait cannot be interrupted to look at the peers, and warns each time a short wait runs out).
    deadline = time.monotonic() + timeout_s
    while not store.check(keys):
        if time.monotonic() >= deadline:
            raise dist.DistError(f"not every rank joined within {timeout_s:g} s")
        peers_alive()
        time.sleep(0.05)


def _open_store(spec: WorldSpec, timeout_s: float) -> dist.Store:
    # Under torchrun's agent, the agent already hosts the store at MASTER_PORT: every rank is a client then.
    agent_hosts_store = spec.from_torchrun and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    is_master = spec.rank == 0 and not agent_hosts_store
    try:
        # multi_tenant, as torch's own rendezvous: a second group in this process may reuse the listening store.
        return dist.TCPStore(
            spec.host,
            spec.port,
            is_master=is_master,
            timeout=timedelta(seconds=timeout_s),
            wait_for_workers=False,
            multi_tenant=True,
        )
    except dist.DistError as exc:
        reason = " ".join(str(exc).split())[:300]
        if is_master:
            raise DistributedInitError(
                f"rank 0 could not listen at {spec.address} ({reason}): pick a free port in --dist-init-addr "
                "(or MASTER_PORT)"
            ) from None
        raise DistributedInitError(
            f"rank {spec.rank} could not reach the rendezvous at {spec.address} within {timeout_s:g} s ({reason}): "
            "start rank 0 there (node 0), check --dist-init-addr / MASTER_ADDR, or raise --dist-timeout"
        ) from None


def _present(store: dist.Store, key: str) -> bool:
    try:
        return store.check([key])
    except dist.DistError:  # the store itself went away (rank 0 gone): nobody can be counted as present
        return False
