"""Tensor parallelism from the process side (cpu, gloo): the engine at TP=2 against TP=1, ranks on two "nodes" and
under torchrun, and what happens when a rank fails, dies, or loses its parent.

Every test here starts processes (each imports torch): few tokens, the small embedded model, one group per test.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from omnirun.assets.default_model import default_model_dir
from omnirun.config import RunnerConfig
from omnirun.distributed.world import TORCHRUN_VARS, free_port
from omnirun.engine import LLM
from omnirun.engine.engine import Engine
from omnirun.errors import EngineStepError, WeightUpdateError, WorkerError
from omnirun.launch import start_runner
from omnirun.sampling import SamplingParams
from omnirun.testing import read_line_within

MODEL = default_model_dir()
FLAGS = dict(device="cpu", dtype="float32", progress=False, seed=0)
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
PROMPTS = [[(7 * i + 3 * j) % 500 + 1 for j in range(5 + 3 * i)] for i in range(6)]


def _drive(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    requests = [engine.add_request(p, params) for p in prompts]
    while engine.has_work:
        engine.step()
    return [r.output_ids for r in requests]


@pytest.fixture(scope="module")
def tp1_tokens() -> list[list[int]]:
    runner = start_runner(RunnerConfig(model=MODEL, max_total_tokens=4096, **FLAGS))
    try:
        return _drive(Engine(runner), PROMPTS, GREEDY)
    finally:
        runner.close()


def test_engine_at_tp2_under_kv_pressure_gives_the_tp1_tokens(tp1_tokens):
    # A pool of 64 tokens cannot hold the six requests together (about 100 tokens): the newest are preempted and
    # recomputed. Overlap scheduling on: the next step's tokens reach rank 1 by broadcast, never through the host.
    runner = start_runner(RunnerConfig(model=MODEL, tp_size=2, max_total_tokens=64, context_length=64, **FLAGS))
    try:
        assert runner.tp.size == 2 and runner.kv.kv_cache.num_kv_heads == 1  # 2 kv heads split over 2 ranks
        engine = Engine(runner, overlap_schedule=True)
        assert _drive(engine, PROMPTS, GREEDY) == tp1_tokens
        assert engine.scheduler.num_preemptions > 0
        usage = engine.kv_usage()
        assert usage.pages_free + usage.pages_cached == usage.pages_total and usage.pages_leaked == 0
    finally:
        runner.close()
    assert all(not p.is_alive() for p in runner.workers.local.processes.values())


def _cli(*args: str, env: dict | None = None) -> subprocess.Popen:
    command = [sys.executable, "-m", "omnirun.cli", "generate", "--device", "cpu", "--dtype", "float32"]
    return subprocess.Popen(
        [*command, "--max-new-tokens", "8", "--ignore-eos", "--prompt", "Hello there", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def _finish(proc: subprocess.Popen, timeout: float = 120) -> tuple[str, str]:
    try:
        return proc.communicate(timeout=timeout)
    finally:
        proc.kill()


@pytest.fixture(scope="module")
def tp1_text() -> str:
    out, err = _finish(_cli())
    assert out.strip(), err[-2000:]
    return out


def test_two_nodes_on_one_machine_give_the_tp1_text(tp1_text):
    addr = f"127.0.0.1:{free_port()}"
    nodes = [_cli("--tp-size", "2", "--nnodes", "2", "--node-rank", str(n), "--dist-init-addr", addr) for n in (0, 1)]
    (out0, err0), (out1, err1) = (_finish(p) for p in nodes)
    assert [p.returncode for p in nodes] == [0, 0], err0[-2000:] + err1[-2000:]
    assert out0 == tp1_text
    assert out1 == ""  # node 1 serves node 0 and prints nothing


def test_torchrun_launch_gives_the_tp1_text(tp1_text):
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS}
    command = ["-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port())]
    proc = subprocess.Popen(
        [sys.executable, *command, "-m", "omnirun.cli", "generate", "--device", "cpu", "--dtype", "float32"]
        + ["--max-new-tokens", "8", "--ignore-eos", "--prompt", "Hello there", "--tp-size", "2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    out, err = _finish(proc)
    assert proc.returncode == 0, err[-3000:]
    assert out == tp1_text  # only rank 0 prints


def test_a_rank_that_raises_is_named_with_its_exception_on_rank_0():
    with LLM(MODEL, tp_size=2, **FLAGS) as llm:
        # A command rank 1 cannot run: it reports its exception and exits, as it would on any bug of its own.
        llm.runner.workers.send("call", ("no_such_method", (), {}))
        started = time.monotonic()
        with pytest.raises(EngineStepError) as caught:
            llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)
        assert time.monotonic() - started < 30
        message = str(caught.value)
        assert "rank 1" in message and "AttributeError" in message and "no_such_method" in message
        assert isinstance(caught.value.__cause__, WorkerError)
        # The group stays failed, with the same one-line reason, and the LLM closes without waiting on it.
        with pytest.raises(EngineStepError, match="no_such_method"):
            llm.generate([[4, 5]], GREEDY, use_tqdm=False)
    assert not llm.runner.workers.local.processes[1].is_alive()


def test_a_killed_rank_is_one_clear_error_on_rank_0_not_a_hang():
    with LLM(MODEL, tp_size=2, **FLAGS) as llm:
        assert llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)[0].token_ids  # the group works
        worker = llm.runner.workers.local.processes[1]
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(10)
        started = time.monotonic()
        with pytest.raises(EngineStepError, match=r"rank 1 \(killed by SIGKILL\)"):
            llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)
        assert time.monotonic() - started < 30


_PARENT = """
import sys, time
from omnirun.engine import LLM
llm = LLM(sys.argv[1], tp_size=2, device="cpu", dtype="float32", progress=False)
print("WORKER", llm.runner.workers.local.processes[1].pid, flush=True)
time.sleep(600)
"""


def test_workers_exit_when_their_parent_is_killed():
    parent = subprocess.Popen(
        [sys.executable, "-c", _PARENT, MODEL], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        line = read_line_within(parent, 300)
        match = re.match(r"WORKER (\d+)", line)
        assert match, line + parent.stderr.read()[-2000:]
        worker_pid = int(match.group(1))
        parent.kill()
        parent.wait(10)
        deadline = time.monotonic() + 15
        while _alive(worker_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(worker_pid), "the worker outlived its killed parent"
    finally:
        parent.kill()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie has exited (its reaper is gone too)
    except FileNotFoundError:
        return False


_TRAINER = """
import os, sys, torch, torch.distributed as dist
from omnirun.distributed.weights_group import join_weights_group
port, path = int(sys.argv[1]), sys.argv[2]
group = join_weights_group(host="127.0.0.1", port=port, rank=0, world_size=3, group_name="rlhf", backend="gloo",
                           timeout_s=120)
dist.broadcast(torch.load(path), group=group, group_src=0)
dist.destroy_process_group(group)
print("SENT", flush=True)
os._exit(0)  # it hosts the group's store: leave before torch tears it down under the connected ranks
"""


def test_weight_calls_of_the_llm_reach_every_rank(tmp_path):
    name = "model.layers.0.self_attn.k_proj.weight"  # 2 kv heads: one on each rank
    prompt = [[3, 1, 4, 1, 5, 9, 2, 6]]
    with LLM(MODEL, **FLAGS) as reference:
        whole = reference.get_weights_by_name(name)
        new = whole + 0.5 * torch.randn(whole.shape, generator=torch.Generator().manual_seed(0))
        reference.update_weights_from_tensor([(name, new)])
        expected = reference.generate(prompt, GREEDY, use_tqdm=False)[0].token_ids
    torch.save(new, tmp_path / "new.pt")
    port = free_port()
    with LLM(MODEL, tp_size=2, **FLAGS) as llm:
        assert torch.equal(llm.get_weights_by_name(name), whole)  # gathered from both ranks
        with pytest.raises(WeightUpdateError, match="shape"):  # refused on every rank; the group goes on
            llm.update_weights_from_tensor([(name, new[:1])])
        trainer = subprocess.Popen(
            [sys.executable, "-c", _TRAINER, str(port), str(tmp_path / "new.pt")],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            llm.init_weights_update_group("127.0.0.1", port, 1, 3, "rlhf", "gloo")
            llm.update_weights_from_distributed([name], [new.dtype], [list(new.shape)], "rlhf")
            llm.destroy_weights_update_group("rlhf")
            out, err = _finish(trainer, timeout=60)
            assert "SENT" in out, err[-2000:]
        finally:
            trainer.kill()
        assert torch.equal(llm.get_weights_by_name(name), new)
        assert llm.generate(prompt, GREEDY, use_tqdm=False)[0].token_ids == expected
