"""refresh_in_place (omnirun.layers.prepared): a platform's form made again after a weight update goes into the
memory of the one before, which captured graphs read, wherever the two have the same structure."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from omnirun.layers import prepared
from omnirun.layers.prepared import held_bytes, made_form, refresh_in_place


@dataclasses.dataclass(frozen=True)
class Form:
    """Shaped as a vendor's form (Ascend's int4 weight): words, per-dtype scales and optional offsets, a number."""

    weight: torch.Tensor
    antiquant: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor | None]]
    group_size: int


def _form(seed: int, offset: bool = True, group_size: int = 32) -> Form:
    gen = torch.Generator().manual_seed(seed)
    scale, shift = torch.rand(2, 4, generator=gen), torch.rand(2, 4, generator=gen)
    antiquant = {
        dtype: (scale.to(dtype), shift.to(dtype) if offset else None) for dtype in (torch.bfloat16, torch.float16)
    }
    return Form(torch.randint(-8, 8, (4, 2), generator=gen, dtype=torch.int32), antiquant, group_size)


def test_the_new_form_is_copied_into_the_old_form_s_tensors():
    old, new = _form(0), _form(1)
    memory = [old.weight.data_ptr(), old.antiquant[torch.bfloat16][0].data_ptr()]
    assert refresh_in_place(old, new)
    assert torch.equal(old.weight, new.weight)
    for dtype in old.antiquant:
        assert all(map(torch.equal, old.antiquant[dtype], new.antiquant[dtype]))
    assert [old.weight.data_ptr(), old.antiquant[torch.bfloat16][0].data_ptr()] == memory


def test_tuples_lists_and_none_refresh_too():
    old, new = (torch.zeros(3), [torch.zeros(2)], None), (torch.ones(3), [torch.ones(2)], None)
    assert refresh_in_place(old, new) and old[0].sum() == 3 and old[1][0].sum() == 2
    assert refresh_in_place(None, None)


def test_a_form_of_another_structure_changes_nothing():
    old = _form(0)
    saved = old.weight.clone()
    others = [
        _form(1, offset=False),  # an offset appeared or went (every zero point became 8)
        _form(1, group_size=64),  # a number outside the tensors
        dataclasses.replace(_form(1), weight=torch.zeros(4, 3, dtype=torch.int32)),  # another shape
        dataclasses.replace(_form(1), weight=torch.zeros(4, 2, dtype=torch.int64)),  # another dtype
        dataclasses.replace(_form(1), weight=torch.zeros(4, 2, dtype=torch.int32).to_sparse()),  # another layout
        (torch.zeros(4).to_mkldnn(),),  # oneDNN's opaque layout (below: never copied into)
        None,  # no form any more
    ]
    for new in others:
        assert not refresh_in_place(old, new)
        assert torch.equal(old.weight, saved)  # untouched, though the weight words matched
    assert not refresh_in_place(None, _form(1))  # a first form
    assert not refresh_in_place((torch.zeros(4).to_mkldnn(),), (torch.ones(4).to_mkldnn(),))


def test_an_opaque_object_is_never_taken_for_the_same():
    class Module:  # as IPEX's prepared linear: its tensors are not reachable, so it is made anew
        pass

    assert not refresh_in_place((Module(),), (Module(),))


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.words = nn.Parameter(torch.arange(8, dtype=torch.int32), requires_grad=False)
        self.scale = nn.Parameter(torch.ones(2), requires_grad=False)


class StandsAlone(tuple):
    reads_loaded_tensors = False


def test_a_form_that_stands_alone_sends_the_loaded_tensors_to_host_memory(monkeypatch):
    # The machine has no device but the host: "meta" plays host memory, which a computation on it would fail to read.
    monkeypatch.setattr(prepared, "HOST", torch.device("meta"))
    for make, kept_on_device in [
        (lambda words, scale: StandsAlone((words * 2, scale.clone())), False),
        (lambda words, scale: (words * 2,), True),  # reads the loaded tensors too (the default)
        (lambda words, scale: None, True),  # no form: the op reads the loaded tensors
    ]:
        layer = Layer()
        form = made_form(layer, ("words", "scale"), make)
        assert [p.device.type for p in (layer.words, layer.scale)] == ["cpu" if kept_on_device else "meta"] * 2
        assert {name for name, _ in layer.named_parameters()} == {"words", "scale"}  # the names stay
        if form is not None:
            assert torch.equal(form[0], torch.arange(8, dtype=torch.int32) * 2)  # made from the loaded values


def test_the_loaded_tensors_come_back_to_the_device_while_a_new_form_is_made(monkeypatch):
    """Host and device are both the CPU here: the moves are recorded, with where each tensor is."""
    where: dict[str, str] = {}

    def place(layer, name, device):
        where[name] = str(device)

    monkeypatch.setattr(prepared, "_place", place)
    layer = Layer()
    layer.loaded_device = torch.device("cuda")  # as loading left it

    def make(words, scale):
        assert where == {"words": "cuda", "scale": "cuda"}  # on the device while the form is made
        return StandsAlone((words.clone(),))

    for _ in range(2):  # after loading, and after an update
        made_form(layer, ("words", "scale"), make)
        assert where == {"words": "cpu", "scale": "cpu"}


def test_held_bytes_count_each_storage_once_and_tell_host_memory_apart(monkeypatch):
    layer = Layer()  # words int32 [8], scale float32 [2]: 32 + 8 bytes
    layer.prepared = (layer.words, torch.zeros(4, dtype=torch.float16))  # shares words; 8 bytes of its own
    assert held_bytes(layer) == (48, 0)
    layer.prepared = (torch.zeros(4).to_mkldnn(),)  # oneDNN's opaque layout has no storage: its elements count
    assert held_bytes(layer) == (56, 0)
    monkeypatch.setattr(prepared, "HOST", torch.device("meta"))  # "meta" plays host memory
    layer.words = nn.Parameter(layer.words.data.to("meta"), requires_grad=False)
    layer.prepared = (torch.zeros(4, dtype=torch.float16),)
    assert held_bytes(layer) == (16, 32)
