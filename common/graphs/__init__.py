"""Graph runners: capture decode steps once per batch size and replay them (no per-kernel launch cost)."""

from __future__ import annotations

from omnirun.facts import GraphAPI
from omnirun.graphs.decode_graphs import DecodeGraphRunner, capture_batch_sizes

__all__ = ["DecodeGraphRunner", "GraphAPI", "capture_batch_sizes"]
