"""A platform's prepared form of a layer's weights, made again after a weight update.

A captured graph reads the memory of the form it captured, so the new form's tensors are copied into the old
form's wherever the two have the same structure: the same containers, tensors of the same shape, dtype and device,
and equal values elsewhere. Where they differ (a form whose layout or host-side numbers depend on the weights) the
layer takes the new form, and the decode graphs are captured again (ModelRunner)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch


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
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and (a.shape, a.dtype, a.device) == (b.shape, b.dtype, b.device)
        )
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # an object whose == is not a plain truth (an array): not known to be the same
        return False
