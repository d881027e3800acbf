"""Attention backends by name: the portable ones in common/, plus those a platform adds for its device."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

from omnirun.attention.backend import AttentionBackend, AttentionContext
from omnirun.attention.batch_invariant import BatchInvariantAttention
from omnirun.attention.torch_native import TorchNativeAttention
from omnirun.errors import ConfigError
from omnirun.facts import AttentionOffer
from omnirun.kernels import offers_triton

if TYPE_CHECKING:
    from omnirun.facts import Capabilities

BackendFactory = Callable[[AttentionContext], AttentionBackend]

TRITON = "triton"


def _build_triton(context: AttentionContext) -> AttentionBackend:
    # Imported here, not at the top: the module imports triton, which `import omnirun` must never do.
    from omnirun.kernels.triton.attention_backend import TritonAttention

    return TritonAttention(context)


# Portable backends: torch_native runs everywhere; triton is offered by the kernels' gate (omnirun.kernels);
# batch_invariant runs everywhere too, for --deterministic (Platform.deterministic_attention_backends).


def portable_offers(capabilities: Capabilities) -> tuple[AttentionOffer, ...]:
    """The portable backends as offers: triton where the kernels' gate offers it, torch_native everywhere."""
    native = AttentionOffer(TorchNativeAttention.name, TorchNativeAttention, capturable=False)
    if offers_triton(capabilities):
        return (AttentionOffer(TRITON, _build_triton, batch_invariant=True), native)
    return (native,)


# Device-neutral torch with fixed key blocks: what --deterministic builds where nothing faster is batch-invariant.
BATCH_INVARIANT_OFFER = AttentionOffer(
    BatchInvariantAttention.name, BatchInvariantAttention, capturable=False, batch_invariant=True
)


def with_portable_offers(own: tuple[AttentionOffer, ...], capabilities: Capabilities) -> tuple[AttentionOffer, ...]:
    """A device's own offers among the portable ones, best first: its own that may be a default, the portable GPU
    ones (triton), its own built only on request, torch_native, and batch_invariant. An own offer of a portable
    name (a tuned build) takes that name's place."""
    names = {offer.name for offer in own}
    portable = [offer for offer in portable_offers(capabilities) if offer.name not in names]
    reference = [offer for offer in portable if offer.name == TorchNativeAttention.name]
    ordered = (
        [offer for offer in own if not offer.on_request]
        + [offer for offer in portable if offer.name != TorchNativeAttention.name]
        + [offer for offer in own if offer.on_request]
        + reference
    )
    if BATCH_INVARIANT_OFFER.name not in names:
        ordered.append(BATCH_INVARIANT_OFFER)
    return tuple(ordered)


def offer_from_factory(name: str, factory: BackendFactory) -> AttentionOffer:
    """A contract-version-1 backend factory as an offer: its `supports_graph` and `batch_invariant` flags."""
    return AttentionOffer(
        name, factory, capturable=factory_supports_graph(factory), batch_invariant=factory_batch_invariant(factory)
    )


def factory_supports_graph(factory: BackendFactory) -> bool:
    """Whether the backend `factory` builds can run in a captured graph, as far as is known before it is built:
    the `supports_graph` flag of a backend class (False for torch_native), or of a factory function that carries
    one. A factory without a plain flag (a function, or a class whose answer depends on the model) counts as
    capturable: the graph runner asks the built backend again before it captures and runs eagerly if it cannot."""
    flag = getattr(factory, "supports_graph", True)
    return flag if isinstance(flag, bool) else True


def factory_batch_invariant(factory: BackendFactory | None) -> bool:
    """Whether the backend `factory` builds honours deterministic mode: the `batch_invariant` flag of a backend
    class, or of a factory function (or the function a functools.partial wraps) that carries one."""
    flag = getattr(factory, "batch_invariant", None)
    if flag is None and isinstance(factory, functools.partial):
        flag = getattr(factory.func, "batch_invariant", None)
    return flag is True


def choose_backend(requested: str | None, offered: tuple[str, ...], default: str, flag: str) -> str:
    """The user's choice when the platform offers it, else the platform's default."""
    if requested is None:
        return default
    if requested not in offered:
        raise ConfigError(f"{flag} {requested!r} is not offered on this device: choose one of {', '.join(offered)}")
    return requested
