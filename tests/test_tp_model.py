"""Tensor-parallel model (cpu, gloo): TP=2 and TP=4 give the TP=1 greedy tokens and logits for every architecture,
dummy weights at TP=N are the TP=1 dummy weights split, and each layer holds the slice of each checkpoint tensor it
should (kv heads replicated when fewer than ranks, the vocabulary padded when it does not divide).

Ranks run SPMD, one process each: this file run as a script joins the world, builds every model and saves what it
saw; one spawn per world size covers every architecture (starting interpreters is the slow part).
"""

from __future__ import annotations

import gc
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from omnirun.batch import build_batch
from omnirun.devices.cpu.platform import CpuPlatform
from omnirun.distributed.tensor_parallel import TensorParallel
from omnirun.layers.embedding import LMHead, VocabEmbedding
from omnirun.layers.ops import Ops
from omnirun.loader import SafetensorsCheckpoint
from omnirun.loader.checkpoint import LazyTensor
from omnirun.models.architecture import decoder_shape
from omnirun.models.decoder import DecoderForCausalLM
from omnirun.testing import (
    ARCHITECTURES,
    MOE_ARCHITECTURES,
    greedy_generate,
    keeping_quantized,
    make_runner,
    tiny_configs,
    tiny_hf_model,
)
from omnirun.weights import load_weights

THIS = Path(__file__).resolve()
PROMPTS = [[(5 * i + 11) % 256 for i in range(9)], [(7 * i + 3) % 256 for i in range(23)]]
NEW_TOKENS = 6
# llama with attention_bias and mlp_bias: o_proj and down_proj biases, which row-parallel layers add once; llama
# with fp8 block-wise weights, dequantized whole before each rank takes its part, and with fp8 blocks kept (on a
# platform offering fp8_linear: each rank holds its blocks and their scales); the mixture-of-experts models, each
# expert's intermediate columns split over the ranks
KEPT_FP8 = "llama_fp8_kept"
# llama as an AWQ checkpoint in groups of 32, kept packed (int4_linear offered): every layer at TP 2; at TP 4 o_proj's
# 16 inputs a rank cut its groups, so those layers are dequantized at load and the others stay packed
KEPT_INT4 = "llama_awq_kept"
# qwen3_moe with fp8 experts in 16 x 16 blocks, kept in fp8 (fp8_fused_moe offered): at TP 2 each rank's 16 of the
# 32 intermediate columns are whole blocks; at TP 4 its 8 cut them, and each rank widens its columns to the whole
# block (8 of them zeros: SparseMoE._fp8_span)
KEPT_FP8_EXPERTS = "qwen3_moe_fp8_kept"
# qwen3_moe as an AWQ checkpoint in groups of 16, experts kept packed (int4_fused_moe offered): at TP 2 each rank's 16
# of the 32 intermediate columns are whole groups of the down projection; at TP 4 its 8 cut them, and each rank widens
# its columns to the whole group (8 of them zeros: SparseMoE._int4_span)
KEPT_INT4_EXPERTS = "qwen3_moe_awq_kept"
MODELS = (
    *ARCHITECTURES, *MOE_ARCHITECTURES, "llama_bias", "llama_fp8", KEPT_FP8, KEPT_INT4, KEPT_FP8_EXPERTS,
    KEPT_INT4_EXPERTS,
)  # fmt: skip
# the same checkpoints with expert parallelism: whole experts per rank (8 experts: TP 2 and 4 both divide them)
EXPERT_PARALLEL = ("mixtral_ep", "qwen3_moe_ep", f"{KEPT_FP8_EXPERTS}_ep", f"{KEPT_INT4_EXPERTS}_ep")
DUMMY = "dummy_vocab251"  # tied (qwen3) and a vocabulary that divides by neither 2 nor 4: padded on every TP size


def _last_logits(runner, prompts) -> torch.Tensor:
    rows = [runner.kv.new_request() for _ in prompts]
    try:
        batch = build_batch(runner.kv, rows, [0] * len(prompts), prompts, runner.device)
        return runner.forward(batch).float().cpu()
    finally:
        for row in rows:
            runner.kv.release(row)


def _observe(runner, *, weights: bool = False) -> dict:
    seen = {
        "tokens": greedy_generate(runner, PROMPTS, NEW_TOKENS),
        "logits": _last_logits(runner, PROMPTS),
        "weight_bytes": runner.weight_bytes_per_step(),
        "experts": runner.describe()["experts"],
        "weights_format": runner.describe()["weights"],
    }
    if weights:
        seen["weights"] = {name: runner.get_weights_by_name(name) for name in runner.model.checkpoint_names()}
    return seen


def _rank_main(world: int, rank: int, port: int, workdir: Path) -> None:
    """One rank: join the world of `world` ranks, run every model at --tp-size `world`, save what it saw."""
    import torch.distributed as dist

    from omnirun.distributed import init_distributed, plan_world
    from omnirun.registry import get_platform

    gc.freeze()  # what the imports made stays: each runner's gc.collect() then skips it (seconds per rank)
    platform = get_platform("cpu")
    spec = plan_world(world, local_rank=rank, dist_init_addr=f"127.0.0.1:{port}", environ={})
    init_distributed(platform, spec, timeout_s=60, device_index=0)
    seen = {}
    for name in (*MODELS, DUMMY, *EXPERT_PARALLEL):
        path, flags = _model(workdir, name)
        runner = make_runner(_keeping(platform, name), path, tp_size=world, **flags)
        seen[name] = _observe(runner, weights=name == DUMMY)
        runner.close()
    torch.save(seen, workdir / f"tp{world}_rank{rank}.pt")
    dist.destroy_process_group()
    sys.stdout.write(f"RESULT rank {rank} done\n")
    sys.stdout.flush()


def _keeping(platform, name: str):
    """The platform a test model runs on: offering the reference quantized op its kept layers call."""
    kept = {
        KEPT_FP8: ("fp8_linear",),
        KEPT_INT4: ("int4_linear",),
        KEPT_FP8_EXPERTS: ("fp8_linear", "fp8_fused_moe"),
        KEPT_INT4_EXPERTS: ("int4_linear", "int4_fused_moe"),
    }
    ops = kept.get(name.removesuffix("_ep"))
    return keeping_quantized(platform, *ops) if ops else platform


def _model(workdir: Path, name: str) -> tuple[Path, dict]:
    """The checkpoint directory of a test model and the flags it runs with."""
    if name == DUMMY:
        return workdir / name, {"load_format": "dummy"}
    if name in EXPERT_PARALLEL:
        return workdir / name.removesuffix("_ep"), {"enable_expert_parallel": True}
    return workdir / name, {}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tp_models")
    for arch in (*ARCHITECTURES, *MOE_ARCHITECTURES):
        tiny_hf_model(arch).save_pretrained(path / arch)
    config = tiny_configs()["llama"]
    config.attention_bias = config.mlp_bias = True
    _save_random(config, path / "llama_bias")
    from quantized_checkpoints import write_fp8_checkpoint, write_int4_checkpoint  # on pytest's path, not the ranks'

    write_fp8_checkpoint(path / "llama_fp8", "llama", (24, 40))
    write_fp8_checkpoint(path / KEPT_FP8, "llama", (16, 16))  # whole blocks on every rank of TP 2 and 4
    write_int4_checkpoint(path / KEPT_INT4, "llama", "awq", 32)
    write_fp8_checkpoint(path / KEPT_FP8_EXPERTS, "qwen3_moe", (16, 16))
    write_int4_checkpoint(path / KEPT_INT4_EXPERTS, "qwen3_moe", "awq", 16)
    config = tiny_configs()["qwen3"]
    config.vocab_size = 251
    config.save_pretrained(path / DUMMY)  # dummy weights: the config alone
    return path


def _save_random(config, path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from omnirun.testing import randomize_constant_parameters

    torch.manual_seed(7)
    model = AutoModelForCausalLM.from_config(config).eval()
    randomize_constant_parameters(model, 7)
    model.save_pretrained(path)


@pytest.fixture(scope="module")
def tp1(workdir) -> dict:
    platform = CpuPlatform()
    seen = {}
    gc.freeze()  # as in the ranks: each runner's gc.collect() skips what was there before
    try:
        for name in (*MODELS, DUMMY):
            path, flags = _model(workdir, name)
            runner = make_runner(_keeping(platform, name), path, **flags)
            seen[name] = _observe(runner, weights=name == DUMMY)
            runner.close()
    finally:
        gc.unfreeze()
    return seen


def _spawn(world: int, workdir: Path) -> list[dict]:
    from omnirun.distributed.world import free_port

    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, str(THIS), str(world), str(rank), str(port), str(workdir)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for rank in range(world)
    ]
    for rank, proc in enumerate(procs):
        try:
            stdout, stderr = proc.communicate(timeout=240)
        finally:
            for other in procs:
                if other.poll() is None and proc.returncode != 0:
                    other.kill()  # one rank failed: the others would wait for it until their timeout
        assert proc.returncode == 0, f"rank {rank}: {stderr[-4000:]}"
        assert re.search(rf"RESULT rank {rank} done", stdout)
    return [torch.load(workdir / f"tp{world}_rank{rank}.pt") for rank in range(world)]


@pytest.fixture(scope="module", params=[2, 4], ids=["tp2", "tp4"])
def tp_n(request, workdir) -> tuple[int, list[dict]]:
    return request.param, _spawn(request.param, workdir)


@pytest.mark.parametrize("name", MODELS)
def test_greedy_tokens_at_tp_n_equal_tp1(tp_n, tp1, name):
    world, ranks = tp_n
    for rank, seen in enumerate(ranks):  # every rank computes the same full logits, so the same tokens
        assert seen[name]["tokens"] == tp1[name]["tokens"], f"tp{world} rank {rank}"


@pytest.mark.parametrize("name", MODELS)
def test_last_token_logits_at_tp_n_within_1e_4_of_tp1(tp_n, tp1, name):
    world, ranks = tp_n
    for seen in ranks:
        assert seen[name]["logits"].shape == tp1[name]["logits"].shape
        torch.testing.assert_close(seen[name]["logits"], tp1[name]["logits"], atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", EXPERT_PARALLEL)
def test_expert_parallel_at_tp_n_equals_tp1(tp_n, tp1, name):
    """Whole experts per rank, each rank computing only the slots routed to its own: the TP=1 tokens and logits."""
    world, ranks = tp_n
    single = tp1[name.removesuffix("_ep")]
    for seen in ranks:
        assert seen[name]["tokens"] == single["tokens"], f"tp{world}"
        torch.testing.assert_close(seen[name]["logits"], single["logits"], atol=1e-4, rtol=0)
    # each rank holds its share of the experts: fewer weight bytes than the whole model
    assert ranks[0][name]["weight_bytes"] < single["weight_bytes"]
    share = 8 // world
    for rank, seen in enumerate(ranks):
        held = f"experts {rank * share}-{rank * share + share - 1} whole"
        # (the kept experts' op: the test platform's, omnirun.testing.keeping_quantized)
        op = {
            KEPT_FP8_EXPERTS: " in fp8, fp8_fused_moe omnirun.testing",
            KEPT_INT4_EXPERTS: " packed in int4, int4_fused_moe omnirun.testing",
        }.get(name.removesuffix("_ep"), ", fused_moe reference")
        assert seen[name]["experts"] == f"top 2 of 8, {held}{op}"


@pytest.mark.parametrize(
    "name, kept",
    [
        (KEPT_FP8_EXPERTS, " in fp8, fp8_fused_moe omnirun.testing"),
        (KEPT_INT4_EXPERTS, " packed in int4, int4_fused_moe omnirun.testing"),
    ],
)
def test_kept_experts_stay_quantized_on_every_rank_whole_blocks_or_groups_or_not(tp_n, tp1, name, kept):
    """At TP 4 each rank's 8 columns cut the 16 x 16 fp8 blocks and the down projection's int4 groups of 16: the
    experts stay quantized, each rank's columns widened to whole blocks or groups (its logits and tokens are TP=1's:
    the test of every model above)."""
    world, ranks = tp_n
    assert tp1[name]["experts"] == f"top 2 of 8, every expert whole{kept}"
    held = f"each expert's columns split {world} ways"
    for seen in ranks:
        assert seen[name]["experts"] == f"top 2 of 8, {held}{kept}"


def test_kept_fp8_blocks_stay_fp8_on_every_rank(tp_n, tp1):
    """The layers of the kept fp8 model hold fp8 on each rank (the logits are checked with the other models')."""
    world, ranks = tp_n
    for seen in (tp1, *ranks):
        assert "8 linear layers kept in fp8" in seen[KEPT_FP8]["weights_format"]


def test_kept_int4_layers_are_packed_where_each_rank_holds_whole_groups(tp_n, tp1):
    world, ranks = tp_n
    assert "8 linear layers kept in int4" in tp1[KEPT_INT4]["weights_format"]
    kept = {2: 8, 4: 6}[world]  # at TP 4, o_proj's 16 inputs a rank cut groups of 32: dequantized at load
    for seen in ranks:
        assert f"{kept} linear layers kept in int4" in seen[KEPT_INT4]["weights_format"]


def test_dummy_weights_at_tp_n_are_the_tp1_dummy_weights_split(tp_n, tp1):
    world, ranks = tp_n
    expected = tp1[DUMMY]["weights"]
    for seen in ranks:
        got = seen[DUMMY]["weights"]  # gathered whole by get_weights_by_name
        assert got.keys() == expected.keys()
        for name, value in expected.items():
            assert torch.equal(got[name], value), name
        torch.testing.assert_close(seen[DUMMY]["logits"], tp1[DUMMY]["logits"], atol=1e-5, rtol=0)
        assert seen[DUMMY]["tokens"] == tp1[DUMMY]["tokens"]


def test_weight_bytes_per_step_counts_this_rank_s_share(tp_n, tp1):
    world, ranks = tp_n
    whole = tp1["llama"]["weight_bytes"]
    shares = [seen["llama"]["weight_bytes"] for seen in ranks]
    assert all(share < whole for share in shares)
    # norms are whole on every rank and kv heads replicate at tp4: the shares sum to at least the whole
    assert sum(shares) >= whole


# --- layer level: which slice of each checkpoint tensor a rank holds (no processes) ---


def _model_at(arch: str, rank: int, size: int, **overrides) -> DecoderForCausalLM:
    config = tiny_configs()[arch]
    for key, value in overrides.items():
        setattr(config, key, value)
    tp = TensorParallel(rank, size, TensorParallel.single().comm)  # collectives unused: nothing runs forward
    return DecoderForCausalLM(decoder_shape(config), config, max_positions=64, ops=Ops(), dtype=torch.float32, tp=tp)


@pytest.mark.parametrize("rank", range(4))
def test_each_rank_s_targets_narrow_the_full_checkpoint_tensor(rank):
    # tiny llama: 4 q heads and 2 kv heads of 16, hidden 64, intermediate 128, vocab 256; at tp 4 each kv head
    # serves two ranks.
    model = _model_at("llama", rank, 4)
    layer = "model.layers.0"
    expected = {
        f"{layer}.self_attn.q_proj.weight": ((64, 64), 0, rank * 16, 16),
        f"{layer}.self_attn.k_proj.weight": ((32, 64), 0, (rank // 2) * 16, 16),
        f"{layer}.self_attn.v_proj.weight": ((32, 64), 0, (rank // 2) * 16, 16),
        f"{layer}.self_attn.o_proj.weight": ((64, 64), 1, rank * 16, 16),
        f"{layer}.mlp.gate_proj.weight": ((128, 64), 0, rank * 32, 32),
        f"{layer}.mlp.up_proj.weight": ((128, 64), 0, rank * 32, 32),
        f"{layer}.mlp.down_proj.weight": ((64, 128), 1, rank * 32, 32),
        "model.embed_tokens.weight": ((256, 64), 0, rank * 64, 64),
        "lm_head.weight": ((256, 64), 0, rank * 64, 64),
    }
    full = torch.arange(256 * 128, dtype=torch.float32)
    for name, (shape, dim, start, length) in expected.items():
        target = model.checkpoint_target(name)
        assert (target.full_shape, target.dim, target.start, target.length) == (shape, dim, start, length), name
        tensor = full[: shape[0] * shape[1]].view(shape)
        assert torch.equal(target.take(tensor), tensor.narrow(dim, start, length)), name
        assert target.view.shape == target.take(tensor).shape, name
    norm = model.checkpoint_target(f"{layer}.input_layernorm.weight")
    assert (norm.full_shape, norm.dim, norm.view.shape) == ((64,), None, (64,))


def test_qwen_biases_split_with_their_heads_and_q_k_norms_stay_whole():
    qwen2 = _model_at("qwen2", 1, 2)
    k_bias = qwen2.checkpoint_target("model.layers.0.self_attn.k_proj.bias")
    assert (k_bias.full_shape, k_bias.dim, k_bias.start, k_bias.length) == ((32,), 0, 16, 16)
    qwen3 = _model_at("qwen3", 1, 2)  # head_dim 32
    q = qwen3.checkpoint_target("model.layers.0.self_attn.q_proj.weight")
    assert (q.full_shape, q.start, q.length) == ((128, 64), 64, 64)
    q_norm = qwen3.checkpoint_target("model.layers.0.self_attn.q_norm.weight")
    assert (q_norm.full_shape, q_norm.dim) == ((32,), None)
    # tied: the head reads the vocab-parallel embedding, and the checkpoint's lm_head.weight is skipped
    assert qwen3.lm_head.weight is qwen3.model.embed_tokens.weight
    assert qwen3.checkpoint_target("lm_head.weight") is None


def test_row_parallel_bias_is_whole_on_every_rank_and_added_by_the_first_only():
    for rank in range(2):
        model = _model_at("llama", rank, 2, attention_bias=True, mlp_bias=True)
        o_proj = model.model.layers[0].self_attn.o_proj
        bias = model.checkpoint_target("model.layers.0.self_attn.o_proj.bias")
        assert (bias.full_shape, bias.dim) == ((64,), None)
        assert o_proj.add_bias == (rank == 0) and o_proj.reduce


def test_vocab_250_at_tp4_pads_every_block_to_63_rows():
    blocks = []
    for rank in range(4):
        tp = TensorParallel(rank, 4, TensorParallel.single().comm)
        embedding = VocabEmbedding(250, 8, dtype=torch.float32, tp=tp)
        target = embedding.checkpoint_slice()
        assert embedding.weight.shape == (63, 8)
        blocks.append((target.start, target.length))
        # the rows past the real vocabulary are zeros, never loaded
        assert torch.equal(embedding.weight[target.length :], torch.zeros(63 - target.length, 8))
    assert blocks == [(0, 63), (63, 63), (126, 63), (189, 61)]
    head = LMHead(250, 8, ops=Ops(), dtype=torch.float32, tied_to=None, tp=TensorParallel(3, 4, tp.comm))
    assert head.padded and head.weight.shape == (63, 8)


def test_a_rank_reads_only_its_own_slices_from_safetensors(tmp_path, monkeypatch):
    hf = tiny_hf_model("qwen2")
    hf.save_pretrained(tmp_path)
    full = hf.state_dict()
    model = _model_at("qwen2", 1, 2)
    reads = []  # (name, index) of every read the safetensors file served: index None for a whole tensor

    class RecordingFile:
        def __init__(self, handle):
            self.handle = handle

        def get_tensor(self, name):
            reads.append((name, None))
            return self.handle.get_tensor(name)

        def get_slice(self, name):
            part = self.handle.get_slice(name)
            return _Indexed(lambda index: reads.append((name, index)) or part[index])

    real_init = LazyTensor.__init__
    monkeypatch.setattr(LazyTensor, "__init__", lambda self, handle, spec: real_init(self, RecordingFile(handle), spec))
    with torch.no_grad():
        load_weights(model, SafetensorsCheckpoint(tmp_path).iter_tensors(lazy=True))
    # whole reads only for what every rank holds whole (the norms); every other tensor through a slice
    assert sorted(name for name, index in reads if index is None) == sorted(
        n for n in full if n.endswith("norm.weight")
    )
    for name, index in reads:
        target = model.checkpoint_target(name)
        assert index == target.index, name
        assert torch.equal(target.view, target.take(full[name])), name
    assert sorted(name for name, _ in reads) == sorted(model.checkpoint_names())


class _Indexed:
    def __init__(self, read):
        self.read = read

    def __getitem__(self, index):
        return self.read(index)


def test_a_single_rank_model_splits_nothing():
    model = _model_at("qwen2", 0, 1)
    for name in model.checkpoint_names():
        target = model.checkpoint_target(name)
        assert target.dim is None and tuple(target.view.shape) == target.full_shape, name
    o_proj = model.model.layers[0].self_attn.o_proj
    assert not o_proj.reduce and not model.model.embed_tokens.parallel and not model.lm_head.parallel


if __name__ == "__main__":
    _rank_main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]))
