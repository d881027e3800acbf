"""The L2 weight prefetch of small batches on a real GPU: a hint that changes no bit of the logits, eager or in
CUDA graphs (whose capture must hold the side stream's fork and join), and asks only for what the bulk copy can
take. Skipped without a Hopper (or later) GPU."""

from __future__ import annotations

import pytest
import torch

from omnirun.devices.cuda.platform import BULK_PREFETCH_MIN_SM, L2_PREFETCH_ENV, CudaPlatform

pytestmark = pytest.mark.device("cuda")

if not torch.cuda.is_available() or torch.cuda.get_device_capability() < BULK_PREFETCH_MIN_SM:
    pytest.skip("needs an NVIDIA GPU of compute capability 9.0 or later", allow_module_level=True)
pytest.importorskip("triton", reason="the prefetch kernel needs triton")

from omnirun.batch import build_batch  # noqa: E402
from omnirun.kernels.triton import l2_prefetch  # noqa: E402
from omnirun.testing import make_runner  # noqa: E402


def test_prefetch_asks_for_whole_chunks_of_contiguous_aligned_weights():
    w = torch.empty(1000, 96, dtype=torch.bfloat16, device="cuda")  # 192,000 bytes: 11 whole chunks
    assert l2_prefetch.prefetch_to_l2(w, 1 << 30) == 11 * l2_prefetch.CHUNK_BYTES
    assert l2_prefetch.prefetch_to_l2(w, 3 * l2_prefetch.CHUNK_BYTES + 5) == 3 * l2_prefetch.CHUNK_BYTES
    assert l2_prefetch.prefetch_to_l2(w.t(), 1 << 30) == 0  # not one contiguous range
    assert l2_prefetch.prefetch_to_l2(w.view(-1)[3:], 1 << 30) == 0  # not 16-byte aligned
    assert l2_prefetch.prefetch_to_l2(w[:10], 1 << 30) == 0  # under one chunk
    torch.cuda.synchronize()


def _decode_logits(runner, steps: int = 6) -> list[torch.Tensor]:
    """Logits of a 20-token prefill of two prompts (eager) and `steps` decode steps (in CUDA graphs)."""
    prompts = [[(7 * j + 3) % 500 for j in range(9)], [(11 * j + 1) % 500 for j in range(11)]]
    rows = [runner.kv.new_request() for _ in prompts]
    out = [runner.forward(build_batch(runner.kv, rows, [0, 0], prompts, runner.device)).clone()]
    lens = [len(p) for p in prompts]
    for step in range(steps):
        batch = build_batch(runner.kv, rows, lens, [[step + 5], [2 * step + 9]], runner.device)
        out.append(runner.forward(batch).clone())
        lens = [n + 1 for n in lens]
    torch.cuda.synchronize()
    return out


def test_prefetch_changes_no_logit_eager_and_in_graphs(monkeypatch):
    asked = []
    real = l2_prefetch.prefetch_to_l2

    def counting(weight, max_bytes):
        asked.append(real(weight, max_bytes))
        return asked[-1]

    monkeypatch.setattr(l2_prefetch, "prefetch_to_l2", counting)
    logits = {}
    for setting in ("0", "1"):
        monkeypatch.setenv(L2_PREFETCH_ENV, setting)
        runner = make_runner(CudaPlatform(), "qwen2.5-0.5b", load_format="dummy", dtype="bfloat16", seed=0)
        assert runner.graph_runner is not None and runner.graph_runner.graphs
        logits[setting] = _decode_logits(runner)
        runner.close()
    # Prefill (20 tokens) and decode (2) both prefetch: o_proj then gate_up, 24 layers, at every forward pass.
    assert sum(asked) > 0 and len(asked) >= 2 * 24
    for step, (on, off) in enumerate(zip(logits["1"], logits["0"], strict=True)):
        assert torch.equal(on, off), f"step {step}: {(on != off).sum().item()} logits differ"
