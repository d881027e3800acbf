"""Weight updates under tensor parallelism (cpu, gloo, TP=2): a good update changes the outputs as it does at TP=1;
an update that fails on one rank only rolls back every rank bit for bit and raises on every rank naming that rank;
a trainer process broadcasting through update_weights_from_distributed gives the outputs update_weights_from_tensor
gives with the same tensors. And the trainer API's one-line refusals (in this process, a group of one).

The ranks run SPMD, one process each (this file run as a script), plus one trainer process: one spawn in all.
"""

from __future__ import annotations

import gc
import hashlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from omnirun.batch import build_batch
from omnirun.devices.cpu.platform import CpuPlatform
from omnirun.errors import WeightUpdateError
from omnirun.testing import greedy_generate, make_runner, tiny_hf_model

THIS = Path(__file__).resolve()
ARCH = "qwen2"  # biases split with their heads, untied head: every kind of target
PROMPTS = [[(5 * i + 11) % 256 for i in range(9)], [(7 * i + 3) % 256 for i in range(17)]]
NEW_TOKENS = 5
GROUP = "trainer_weights"
WORLD = 2


def _logits(runner) -> torch.Tensor:
    rows = [runner.kv.new_request() for _ in PROMPTS]
    try:
        batch = build_batch(runner.kv, rows, [0] * len(PROMPTS), PROMPTS, runner.device)
        return runner.forward(batch).float().cpu()
    finally:
        for row in rows:
            runner.kv.release(row)


def _outputs(runner) -> dict:
    return {"logits": _logits(runner), "tokens": greedy_generate(runner, PROMPTS, NEW_TOKENS)}


def _param_hashes(runner) -> dict[str, str]:
    return {
        name: hashlib.sha256(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
        for name, p in runner.model.named_parameters()
    }


def _fail_on_this_rank_after(count: int):
    """Make this rank's copy of the `count`-th tensor of the next update raise (the other ranks copy everything)."""
    import omnirun.weights as weights

    real = weights.read_part
    calls = [0]

    def failing(source, target):
        calls[0] += 1
        if calls[0] == count:
            raise RuntimeError("injected copy failure")
        return real(source, target)

    weights.read_part = failing
    return lambda: setattr(weights, "read_part", real)


def _rank_main(rank: int, port: int, trainer_port: int, workdir: Path) -> None:
    import torch.distributed as dist

    from omnirun.distributed import init_distributed, plan_world
    from omnirun.registry import get_platform

    gc.freeze()  # what the imports made stays: the runner's gc.collect() then skips it
    platform = get_platform("cpu")
    spec = plan_world(WORLD, local_rank=rank, dist_init_addr=f"127.0.0.1:{port}", environ={})
    init_distributed(platform, spec, timeout_s=60, device_index=0)
    updates = torch.load(workdir / "updates.pt")
    seen = {}
    runner = make_runner(platform, workdir / ARCH, tp_size=WORLD)
    runner.update_weights_from_tensor(updates["good"].items())
    seen["good"] = _outputs(runner)

    before = _param_hashes(runner)
    restore = _fail_on_this_rank_after(5) if rank == 1 else lambda: None
    try:
        runner.update_weights_from_tensor(updates["corrupt"].items())
        seen["corrupt_error"] = None
    except WeightUpdateError as exc:
        seen["corrupt_error"] = str(exc)
    finally:
        restore()
    seen["hashes_unchanged"] = _param_hashes(runner) == before
    seen["after_corrupt"] = _outputs(runner)

    trained = updates["trained"]
    runner.init_weights_update_group("127.0.0.1", trainer_port, 1, WORLD + 1, GROUP, "gloo")
    names = list(trained)
    dtypes = [str(t.dtype).removeprefix("torch.") for t in trained.values()]  # names, as a JSON request gives them
    runner.update_weights_from_distributed(names, dtypes, [list(t.shape) for t in trained.values()], GROUP)
    runner.destroy_weights_update_group(GROUP)
    seen["distributed"] = _outputs(runner)
    seen["full_weight"] = runner.get_weights_by_name("model.layers.1.self_attn.k_proj.weight")
    # the same tensors given directly, from the same starting point: the same bits
    runner.update_weights_from_tensor(updates["good"].items())
    runner.update_weights_from_tensor(trained.items())
    seen["from_tensor"] = _outputs(runner)
    runner.close()
    torch.save(seen, workdir / f"rank{rank}.pt")
    dist.destroy_process_group()
    sys.stdout.write(f"RESULT rank {rank} done\n")
    sys.stdout.flush()


# The trainer: rank 0 of the weights group, broadcasting each tensor in the order the ranks were told. Run with
# `python -c` so that it imports torch and the group helper only (not transformers): one interpreter less to wait for.
TRAINER = """
import os, sys, torch, torch.distributed as dist
from omnirun.distributed.weights_group import join_weights_group
port, workdir, group_name, world_size = int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
trained = torch.load(workdir + "/updates.pt")["trained"]
group = join_weights_group(host="127.0.0.1", port=port, rank=0, world_size=world_size, group_name=group_name,
                           backend="gloo", timeout_s=120)
for tensor in trained.values():
    dist.broadcast(tensor.contiguous(), group=group, group_src=0)
dist.destroy_process_group(group)
sys.stdout.write("RESULT trainer done\\n")
sys.stdout.flush()
# The trainer hosts the group's TCPStore: torch aborts ("terminate called without an active exception") when the
# process hosting a store exits normally while the ranks are still connected to it. Its work is done: leave at once.
os._exit(0)
"""


def _state(seed: int) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in tiny_hf_model(ARCH, seed=seed).state_dict().items()}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tp_weights")
    tiny_hf_model(ARCH).save_pretrained(path / ARCH)
    trained = _state(77)
    # a partial update from the trainer: one layer's attention (q/k/v with biases, o_proj) and the embedding
    trained = {n: t for n, t in trained.items() if ".layers.1.self_attn." in n or n == "model.embed_tokens.weight"}
    torch.save({"good": _state(99), "corrupt": _state(55), "trained": trained}, path / "updates.pt")
    return path


@pytest.fixture(scope="module")
def tp1(workdir) -> dict:
    updates = torch.load(workdir / "updates.pt")
    gc.freeze()
    try:
        runner = make_runner(CpuPlatform(), workdir / ARCH)
        seen = {"base": _outputs(runner)}
        runner.update_weights_from_tensor(updates["good"].items())
        seen["good"] = _outputs(runner)
        runner.update_weights_from_tensor(updates["trained"].items())
        seen["trained"] = _outputs(runner)
        seen["full_weight"] = runner.get_weights_by_name("model.layers.1.self_attn.k_proj.weight")
        runner.close()
    finally:
        gc.unfreeze()
    return seen


@pytest.fixture(scope="module")
def ranks(workdir) -> list[dict]:
    from omnirun.distributed.world import free_port

    port, trainer_port = free_port(), free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    argvs = [[str(THIS), str(rank), str(port), str(trainer_port), str(workdir)] for rank in range(WORLD)]
    argvs.append(["-c", TRAINER, str(trainer_port), str(workdir), GROUP, str(WORLD + 1)])
    procs = [
        subprocess.Popen([sys.executable, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=env)
        for argv in argvs
    ]  # fmt: skip
    outputs = []
    try:
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=240)
            outputs.append((proc.returncode, stdout, stderr))
            if proc.returncode != 0:
                break
    finally:
        for proc in procs:
            proc.kill()
    for who, (code, stdout, stderr) in zip(["rank 0", "rank 1", "trainer"], outputs, strict=False):
        assert code == 0, f"{who}: {stderr[-4000:]}"
        assert re.search(rf"RESULT {who} done", stdout)
    return [torch.load(workdir / f"rank{rank}.pt") for rank in range(WORLD)]


def test_a_good_update_changes_outputs_as_at_tp1(ranks, tp1):
    assert tp1["good"]["tokens"] != tp1["base"]["tokens"]  # the update does change what the model says
    for seen in ranks:
        assert seen["good"]["tokens"] == tp1["good"]["tokens"]
        torch.testing.assert_close(seen["good"]["logits"], tp1["good"]["logits"], atol=1e-4, rtol=0)


def test_a_failure_on_one_rank_rolls_back_every_rank_bit_for_bit(ranks):
    for rank, seen in enumerate(ranks):
        message = seen["corrupt_error"]
        assert message is not None, f"rank {rank} raised nothing"
        assert "\n" not in message
        assert "failed on rank(s) 1 and was rolled back on every rank" in message
        assert "rank 1: RuntimeError: injected copy failure" in message
        assert seen["hashes_unchanged"], f"rank {rank} kept some of the failed update"
        assert torch.equal(seen["after_corrupt"]["logits"], seen["good"]["logits"])


def test_weights_from_a_trainer_give_the_outputs_of_the_same_tensors_given_directly(ranks, tp1):
    for seen in ranks:
        assert torch.equal(seen["distributed"]["logits"], seen["from_tensor"]["logits"])
        assert seen["distributed"]["tokens"] == seen["from_tensor"]["tokens"] == tp1["trained"]["tokens"]
        torch.testing.assert_close(seen["distributed"]["logits"], tp1["trained"]["logits"], atol=1e-4, rtol=0)
        # read back whole (gathered over the ranks): the trainer's k_proj, kv heads split over the two ranks
        assert torch.equal(seen["full_weight"], tp1["full_weight"])


# --- the trainer API's refusals, in this process (a weights group of one: this runner alone) ---


@pytest.fixture(scope="module")
def solo(workdir):
    from omnirun.distributed.world import free_port

    runner = make_runner(CpuPlatform(), workdir / ARCH)
    runner.init_weights_update_group("127.0.0.1", free_port(), 0, 1, "solo", "gloo")
    yield runner
    runner.destroy_weights_update_group("solo")
    runner.close()


def _one_line(excinfo) -> str:
    assert "\n" not in str(excinfo.value)
    return str(excinfo.value)


def test_an_unknown_group_name_is_a_one_line_error(solo):
    with pytest.raises(WeightUpdateError) as excinfo:
        solo.update_weights_from_distributed(["model.norm.weight"], ["float32"], [[64]], "nope")
    assert "no weights update group named 'nope' (joined: 'solo')" in _one_line(excinfo)
    with pytest.raises(WeightUpdateError, match="call init_weights_update_group first"):
        solo.destroy_weights_update_group("nope")


@pytest.mark.parametrize(
    "dtypes, shapes, message",
    [
        (["floaty"], [[64]], "dtype 'floaty' of 'model.norm.weight' is not a torch dtype"),
        (["float32"], [[64, -1]], "shape [64, -1] of 'model.norm.weight' is not a list of non-negative ints"),
        (["float32", "float32"], [[64]], "1 names, 2 dtypes and 1 shapes given"),
    ],
)
def test_metadata_that_cannot_be_received_is_refused_before_anything_is_received(solo, dtypes, shapes, message):
    before = _param_hashes(solo)
    with pytest.raises(WeightUpdateError) as excinfo:
        solo.update_weights_from_distributed(["model.norm.weight"], dtypes, shapes, "solo")
    assert message in _one_line(excinfo) and "nothing received" in _one_line(excinfo)
    assert _param_hashes(solo) == before


@pytest.mark.parametrize(
    "dtype, shape, message",
    [
        ("float32", [32], "'model.norm.weight' has shape [32], the model expects [64]"),
        ("int32", [64], "'model.norm.weight' is stored as int32, which does not convert"),
    ],
)
def test_a_received_tensor_of_the_wrong_shape_or_dtype_changes_nothing(solo, dtype, shape, message):
    before = _param_hashes(solo)
    with pytest.raises(WeightUpdateError) as excinfo:
        solo.update_weights_from_distributed(["model.norm.weight"], [dtype], [shape], "solo")
    assert "refused, nothing changed" in _one_line(excinfo) and message in _one_line(excinfo)
    assert _param_hashes(solo) == before


if __name__ == "__main__":
    _rank_main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]))
