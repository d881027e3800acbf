"""The host CPU with decode graphs: recorded graphs (omnirun_fakes.device.RecordingGraph) up to batch 8 and a
capturable variant of torch_native attention, for tests of what graphs must see (sampling in the graph, weight
updates) on a machine without a graph-capturing device."""

from __future__ import annotations

import torch

from omnirun.attention.torch_native import TorchNativeAttention, _DecodeMetadata
from omnirun.devices.cpu.platform import CpuPlatform
from omnirun.facts import AttentionOffer, GraphAPI
from omnirun_fakes.device import recording_graph_api


class GraphTorchNative(TorchNativeAttention):
    """torch_native whose decode metadata is computed inside the step over the table's whole width (no host read
    of the lengths), so that a recording graph captures it."""

    name = "graph_torch_native"
    supports_graph = True
    _in_graph = False

    def init_graph_state(self, max_batch_size: int) -> None:
        pass

    def init_forward_metadata_capture(self, batch) -> None:
        self._in_graph = True

    def init_forward_metadata_replay(self, batch, padded_batch_size: int) -> None:
        pass

    def init_forward_metadata(self, batch) -> None:
        self._in_graph = False
        super().init_forward_metadata(batch)

    def forward_decode(self, q, k, v, layer, batch):
        if self._in_graph:
            table = self.context.kv.req_to_token.table
            positions = torch.arange(table.shape[1], device=q.device)
            valid = positions[None, :] < batch.seq_lens[:, None]
            slots = torch.where(valid, table[batch.req_pool_indices], 0).long()
            last = (batch.seq_lens - 1).long()[:, None]
            self._decode = _DecodeMetadata(slots, positions, last, {None: valid[:, None, None, :]})
        return super().forward_decode(q, k, v, layer, batch)


class GraphCpu(CpuPlatform):
    """The host CPU with recorded graphs up to batch 8 and the capturable attention above."""

    max_graph_batch_size = 8

    def graph_api(self) -> GraphAPI:
        return recording_graph_api("recorded")

    def attention_offers(self):
        return (AttentionOffer(GraphTorchNative.name, GraphTorchNative),)
