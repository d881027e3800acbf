"""A platform's prepared form of a layer's weights: where the loaded tensors live, and the form made again after a
weight update.

A form whose op reads nothing but the form (`reads_loaded_tensors = False` on it, as a vendor's re-packed weight with
its scales) would leave the device holding the weights twice: the loaded tensors then wait in host memory, where
weight updates and reads find them, and come back to the device only while a new form is made from them.

A captured graph reads the memory of the form it captured, so the new form's tensors are copied into the old
form's wherever the two have the same structure: the same containers, tensors of the same shape, dtype and device,
and equal values elsewhere. Where they differ (a form whose layout or host-side numbers depend on the weights) the
layer takes the new form, and the decode graphs are captured again (ModelRunner)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

HOST = torch.device("cpu")


def made_form(layer: nn.Module, names: Sequence[str], make: Callable[..., Any]) -> Any:
    """`make(*tensors)` of the layer's loaded tensors `names`, on the device the layer computes on; afterwards the
    tensors go to host memory if the form says its op does not read them."""
    device = getattr(layer, "loaded_device", None) or getattr(layer, names[0]).device
    layer.loaded_device = device  # where loading put them: the device the layer computes on
    for name in names:
        _place(layer, name, device)
    form = make(*(getattr(layer, name) for name in names))
    if not reads_loaded_tensors(form):
        for name in names:
            _place(layer, name, HOST)
    return form


def _place(layer: nn.Module, name: str, device: torch.device) -> None:
    """Move a parameter to `device` as a new Parameter of the same name (a device's own tensor type, such as
    torch_npu's, cannot take another device's data in place): updates and reads look it up by name."""
    param = getattr(layer, name)
    if param.device != device:
        setattr(layer, name, nn.Parameter(param.data.to(device), requires_grad=False))


def held_bytes(model: nn.Module) -> tuple[int, int]:
    """(bytes on the device, bytes in host memory) of the model's parameters and its layers' prepared forms, each
    storage counted once (a form may share one with a parameter). On a device that is the host, all count as
    the device's."""
    storages: dict[tuple[torch.device, int], int] = {}
    tensors = list(model.parameters())
    tensors += [t for m in model.modules() for t in _parts(getattr(m, "prepared", None)) if isinstance(t, torch.Tensor)]
    for tensor in tensors:
        if tensor.layout == torch.strided and not tensor.is_mkldnn:
            storage = tensor.untyped_storage()
            storages[(tensor.device, storage.data_ptr())] = storage.nbytes()
        else:  # an opaque layout (oneDNN's blocked weights) has no storage to share: its own elements
            storages[(tensor.device, id(tensor))] = tensor.numel() * tensor.element_size()
    on_host = sum(size for (device, _), size in storages.items() if device == HOST)
    total = sum(storages.values())
    devices = {device for device, _ in storages}
    return (total, 0) if devices <= {HOST} else (total - on_host, on_host)


def loaded_on(device: torch.device, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A layer's loaded tensors on `device`, for an op whose form stands alone but which falls back to the reference:
    they wait in host memory then."""
    return tuple(tensor.to(device) for tensor in tensors)


def reads_loaded_tensors(form: Any) -> bool:
    """Whether the op of this form reads the layer's loaded tensors too (no form: it reads only them)."""
    return form is None or getattr(form, "reads_loaded_tensors", True)


def refresh_in_place(old: Any, new: Any) -> bool:
    """Copy `new`'s tensors into `old`'s and return True where the two forms have the same structure; else change
    nothing and return False."""
    old_parts, new_parts = _parts(old), _parts(new)
    if len(old_parts) != len(new_parts) or not all(map(_same_place, old_parts, new_parts)):
        return False
    for a, b in zip(old_parts, new_parts, strict=True):
        if isinstance(a, torch.Tensor) and a is not b:
            a.copy_(b)
    return True


def _parts(form: Any) -> list[Any]:
    """The form flattened: each container's type and size (dict keys included), then its items, tensors as leaves."""
    if isinstance(form, torch.Tensor):
        return [form]
    if dataclasses.is_dataclass(form) and not isinstance(form, type):
        return [type(form)] + [part for field in dataclasses.fields(form) for part in _parts(getattr(form, field.name))]
    if isinstance(form, dict):
        return [type(form), tuple(form)] + [part for value in form.values() for part in _parts(value)]
    if isinstance(form, (list, tuple)):
        return [type(form), len(form)] + [part for item in form for part in _parts(item)]
    return [form]


def _same_place(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        # Plain strided tensors only: an opaque layout (oneDNN's blocked weights) may not copy in place.
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and (a.shape, a.dtype, a.device) == (b.shape, b.dtype, b.device)
            and a.layout == b.layout == torch.strided
        )
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # an object whose == is not a plain truth (an array): not known to be the same
        return False
