"""Host data onto a device without waiting for the device.

`torch.tensor(data, device=d)` copies with non_blocking=False: on CUDA (and HIP) that is a cudaMemcpyAsync followed
by a cudaStreamSynchronize, so the host waits for every kernel already queued. On the decode path that is the
forward pass just launched, and the wait undoes overlap scheduling. A tensor built on the host and copied with
non_blocking=True waits for nothing, and is safe from pageable memory: the copy has read its source when the call
returns (PyTorch's tutorial on pin_memory and non_blocking; SGLang PR #35106 removes the same syncs).
"""

from __future__ import annotations

from typing import Any

import torch


def to_device(data: Any, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """`torch.tensor(data, dtype=dtype, device=device)` without a stream synchronisation."""
    return torch.tensor(data, dtype=dtype).to(device, non_blocking=True)
