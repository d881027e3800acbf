"""What a run builds from its flags and the platform's offers: the prefill and decode attention backends, the
linear layers in deterministic mode, and whether decode steps are captured as graphs. The runner builds what this
decides; `omnirun env` and the conformance report print the same decisions, so what they say is what a run builds.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from omnirun.attention.registry import choose_backend
from omnirun.errors import ConfigError

if TYPE_CHECKING:
    from omnirun.config import RunnerConfig
    from omnirun.platform import Platform


@dataclasses.dataclass(frozen=True)
class Assembly:
    """The parts one run builds, and why decode runs eagerly where it does."""

    prefill_attention: str
    decode_attention: str
    # The graph API's name (cuda_graph, ...) when decode steps up to `graph_max_batch_size` run as captured
    # graphs; None: every step runs eagerly, `graphs_reason` says why.
    graphs: str | None
    graph_max_batch_size: int | None
    graphs_reason: str
    # What deterministic mode's linear layers run (None outside it).
    deterministic_linear: str | None

    def summary(self) -> str:
        """One line for logs and reports."""
        graphs = f"{self.graphs} up to batch {self.graph_max_batch_size}" if self.graphs else "eager"
        text = f"attention prefill {self.prefill_attention}, decode {self.decode_attention}; graphs {graphs}"
        if self.graphs is None:
            text += f" ({self.graphs_reason})"
        if self.deterministic_linear is not None:
            text += f"; deterministic linear: {self.deterministic_linear}"
        return text


def choose_attention(config: RunnerConfig, platform: Platform, model_dtype: torch.dtype) -> tuple[str, str]:
    """The (prefill, decode) attention backends: the user's choice where the platform offers it, else the
    platform's default for the model's dtype. In deterministic mode only batch-invariant backends are offered,
    the platform's best of them the default."""
    offered = platform.deterministic_attention_backends() if config.deterministic else platform.attention_backends()

    def choose(mode: str) -> str:
        own = getattr(config, f"{mode}_attention_backend")
        flag = f"--{mode}-attention-backend" if own is not None else "--attention-backend"
        requested = own or config.attention_backend
        if not config.deterministic:
            default = platform.default_attention_backend_for(mode, model_dtype)
            return choose_backend(requested, offered, default, flag)
        if requested is not None and requested not in offered:
            raise ConfigError(
                f"{flag} {requested!r} is not batch-invariant, which --deterministic needs: choose one of "
                f"{', '.join(offered)}, or drop --deterministic"
            )
        return requested or offered[0]

    return choose("prefill"), choose("decode")


def deterministic_linear(platform: Platform) -> str:
    """What deterministic mode's linear layers run on this platform (`omnirun.layers.ops.deterministic_ops`)."""
    if "batch_invariant_linear" in platform.fused_ops():
        return "the platform's batch_invariant_linear kernel"
    return "the platform's linear in fixed blocks of rows"


def assemble(
    config: RunnerConfig,
    platform: Platform,
    model_dtype: torch.dtype,
    max_running_requests: int,
    head_dim: int | None = None,
    experts: bool = False,
) -> Assembly:
    """The parts a runner of `config` builds on `platform` for a model computing in `model_dtype` (`head_dim`:
    the model's, where a backend's graphs depend on it; None where no model is known, as in `omnirun env`;
    `experts`: the model has mixture-of-experts layers)."""
    prefill, decode = choose_attention(config, platform, model_dtype)
    api = platform.graph_api()
    offer = platform.attention_offer(decode)
    graphs, max_batch, reason = None, None, ""
    if config.disable_graph:
        reason = "--disable-graph"
    elif api is None:
        reason = f"{platform.name} has no graph API"
    elif offer is not None and not offer.capturable_for(head_dim):
        at = "" if head_dim is None else f" at head_dim {head_dim}"
        reason = f"the {decode} decode backend cannot be captured{at}"
    elif experts and "fused_moe" not in platform.fused_ops():
        # The reference picks each expert's tokens on the host: a graph cannot hold that.
        reason = f"{platform.name} offers no fused_moe kernel, and the reference syncs with the host"
    else:
        graphs = api.name
        max_batch = min(max_running_requests, config.max_graph_batch_size or platform.max_graph_batch_size)
    return Assembly(
        prefill_attention=prefill,
        decode_attention=decode,
        graphs=graphs,
        graph_max_batch_size=max_batch,
        graphs_reason=reason,
        deterministic_linear=deterministic_linear(platform) if config.deterministic else None,
    )
