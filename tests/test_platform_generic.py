"""The generic Platform methods against a recording stub of a device module (torch.cuda's API and lazy start-up):
each call reaches the module with the right device, and a probe that counts devices leaves it uninitialised.

The contract suite runs these rules on real devices; on CPU-backed platforms (torch.cpu starts initialised, runs
synchronously) they cannot fail there, so they are checked here."""

from __future__ import annotations

import pytest
import torch

from omnirun.platform import Platform, ProbeResult

# torch.cuda's lazy start-up: these create the context (torch.cuda.init docs; device_count/is_available do not).
INITIALISING = {
    "current_device",
    "set_device",
    "synchronize",
    "Stream",
    "Event",
    "mem_get_info",
    "empty_cache",
    "max_memory_allocated",
    "reset_peak_memory_stats",
}


class StubDeviceModule:
    def __init__(self, count: int = 4):
        self.count, self.current, self.initialised, self.calls = count, 0, False, []

    def _call(self, name, *args, **kwargs):
        self.calls.append((name, *args, *kwargs.values()))
        self.initialised |= name in INITIALISING

    def is_initialized(self):
        return self.initialised

    def device_count(self):
        self._call("device_count")
        return self.count

    def current_device(self):
        self._call("current_device")
        return self.current

    def set_device(self, index):
        self._call("set_device", index)
        self.current = index

    def synchronize(self, device=None):
        self._call("synchronize", device)

    def Stream(self, device):  # noqa: N802 (torch's name)
        self._call("Stream", device)
        return ("stream", device)

    def Event(self, enable_timing=False):  # noqa: N802
        self._call("Event", enable_timing)
        return ("event", enable_timing)

    def mem_get_info(self, device):
        self._call("mem_get_info", device)
        return 3 * 2**30, 8 * 2**30

    def empty_cache(self):
        self._call("empty_cache")

    def max_memory_allocated(self, device):
        self._call("max_memory_allocated", device)
        return 123

    def reset_peak_memory_stats(self, device):
        self._call("reset_peak_memory_stats", device)


class StubPlatform(Platform):
    name = "stub"
    torch_device_type = "cuda"  # any type torch.device parses; the module is the stub
    api_version = 2
    distributed_backend = "gloo"

    def __init__(self, module: StubDeviceModule, probe_calls: str = "device_count"):
        self.module, self.probe_calls = module, probe_calls

    @property
    def device_module(self):
        return self.module

    def _probe(self):
        return ProbeResult.ok(getattr(self.module, self.probe_calls)())

    def _capabilities(self):
        raise AssertionError("these tests never need the capabilities")


def test_a_probe_that_counts_devices_leaves_the_device_uninitialised():
    module = StubDeviceModule()
    platform = StubPlatform(module)
    assert platform.probe() == ProbeResult.ok(4) and platform.device_count() == 4
    assert not module.is_initialized()


def test_the_stub_notices_a_probe_that_initialises():
    module = StubDeviceModule()
    StubPlatform(module, probe_calls="current_device").probe()  # a bad probe: asks for the current device
    assert module.is_initialized()


def test_device_control_reaches_the_module_with_the_device_asked_for():
    module = StubDeviceModule()
    platform = StubPlatform(module)
    platform.set_device(2)
    assert module.calls[-1] == ("set_device", 2)
    assert platform.current_device() == 2 and platform.device() == torch.device("cuda", 2)
    assert platform.device(3) == torch.device("cuda", 3)
    platform.synchronize(1)
    assert module.calls[-1] == ("synchronize", 1)
    platform.synchronize()
    assert module.calls[-1] == ("synchronize", None)  # the current device, as torch.cuda.synchronize(None) means


def test_streams_and_events_come_from_the_module():
    module = StubDeviceModule()
    platform = StubPlatform(module)
    platform.set_device(1)
    assert platform.stream() == ("stream", torch.device("cuda", 1))
    assert platform.stream(3) == ("stream", torch.device("cuda", 3))
    assert platform.event(enable_timing=True) == ("event", True)
    assert platform.event() == ("event", False)


def test_memory_queries_name_the_device():
    module = StubDeviceModule()
    platform = StubPlatform(module)
    platform.set_device(1)
    assert platform.memory_info() == (3 * 2**30, 8 * 2**30)
    assert module.calls[-1] == ("mem_get_info", torch.device("cuda", 1))
    platform.memory_info(2)
    assert module.calls[-1] == ("mem_get_info", torch.device("cuda", 2))
    assert platform.peak_memory_allocated(3) == 123
    assert module.calls[-1] == ("max_memory_allocated", torch.device("cuda", 3))
    platform.reset_peak_memory(0)
    assert module.calls[-1] == ("reset_peak_memory_stats", torch.device("cuda", 0))
    platform.empty_cache()
    assert module.calls[-1] == ("empty_cache",)


def test_an_unavailable_platform_refuses_capabilities():
    module = StubDeviceModule(count=0)

    class NoDevice(StubPlatform):
        def _probe(self):
            return ProbeResult.unavailable("no stub device:\n  check the driver")

    platform = NoDevice(module)
    assert platform.probe().reason == "no stub device: check the driver"  # folded onto one line
    with pytest.raises(Exception, match="no stub device"):
        platform.capabilities  # noqa: B018
