"""Discovery and selection rules of the platform registry, over hand-made entry points."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from omnirun.errors import (
    DeviceUnavailableError,
    DuplicatePlatformError,
    OmnirunError,
    PluginLoadError,
    UnknownDeviceError,
)
from omnirun.facts import SUPPORTED_API_VERSIONS
from omnirun.platform import PLATFORM_API_VERSION, Capabilities, Platform, ProbeResult
from omnirun.registry import DEVICE_ENV_VAR, OmnirunDeprecationWarning, PlatformRegistry


def make_platform(name: str, available: bool = True, priority: int = 50, reason: str = "") -> type[Platform]:
    class Fake(Platform):
        torch_device_type = "cpu"
        api_version = 2
        distributed_backend = "gloo"
        auto_priority = priority

        def _probe(self) -> ProbeResult:
            return ProbeResult.ok(1) if available else ProbeResult.unavailable(reason or f"{name} is switched off")

        def _capabilities(self) -> Capabilities:
            return Capabilities(name, (torch.float32,), None, None, supports_triton=False)

    Fake.name = name
    return Fake


@dataclasses.dataclass
class Dist:
    name: str
    version: str = "1.0"


@dataclasses.dataclass
class EntryPoint:
    """What the registry reads of an importlib.metadata.EntryPoint."""

    name: str
    target: object
    dist: Dist = dataclasses.field(default_factory=lambda: Dist("vendor-pkg"))

    @property
    def value(self) -> str:
        return f"vendor_pkg.platform:{self.name}"

    def load(self):
        if isinstance(self.target, Exception):
            raise self.target
        return self.target


def registry(*eps: EntryPoint) -> PlatformRegistry:
    return PlatformRegistry.discover(eps)


@pytest.fixture(autouse=True)
def _no_device_env(monkeypatch):
    monkeypatch.delenv(DEVICE_ENV_VAR, raising=False)


def test_auto_picks_highest_priority_available_then_name():
    reg = registry(
        EntryPoint("cpu", make_platform("cpu", priority=0)),
        EntryPoint("big", make_platform("big", available=False, priority=100)),
        EntryPoint("beta", make_platform("beta", priority=80)),
        EntryPoint("alpha", make_platform("alpha", priority=80)),
    )
    assert reg.names() == ["big", "alpha", "beta", "cpu"]
    assert reg.select("auto").name == "alpha"
    assert reg.select(None).name == "alpha"


def test_explicit_unavailable_device_fails_with_probe_reason():
    reg = registry(
        EntryPoint("cpu", make_platform("cpu", priority=0)),
        EntryPoint("npu", make_platform("npu", available=False, reason='torch_npu is missing: pip install "x[npu]"')),
    )
    with pytest.raises(DeviceUnavailableError) as err:
        reg.select("npu")
    assert str(err.value) == """device 'npu' is unavailable: torch_npu is missing: pip install "x[npu]\""""


def test_env_var_selects_and_flag_beats_it(monkeypatch):
    reg = registry(EntryPoint("cpu", make_platform("cpu", priority=0)), EntryPoint("gpu", make_platform("gpu")))
    monkeypatch.setenv(DEVICE_ENV_VAR, "cpu")
    assert reg.select(None).name == "cpu"
    assert reg.select("gpu").name == "gpu"
    monkeypatch.setenv(DEVICE_ENV_VAR, " GPU ")
    assert reg.select(None).name == "gpu"


def test_unknown_device_lists_the_choices():
    reg = registry(EntryPoint("cpu", make_platform("cpu")))
    with pytest.raises(UnknownDeviceError, match=r"unknown device 'tpu': choose one of cpu, auto"):
        reg.select("tpu")


def test_unknown_device_from_the_environment_says_so(monkeypatch):
    monkeypatch.setenv(DEVICE_ENV_VAR, "tpu")
    with pytest.raises(UnknownDeviceError, match=r"unknown device 'tpu' \(from OMNIRUN_DEVICE\): choose one of"):
        registry(EntryPoint("cpu", make_platform("cpu"))).select(None)


def test_plugin_raising_on_load_is_reported_with_name_and_exception(caplog):
    reg = registry(
        EntryPoint("cpu", make_platform("cpu", priority=0)),
        EntryPoint("acme", ImportError("libacme.so: cannot open shared object file"), Dist("acme-omnirun", "0.3")),
    )
    assert "acme" in reg.names() and "acme" not in reg.platforms
    expected = (
        "platform plugin 'acme' from acme-omnirun 0.3 (vendor_pkg.platform:acme) failed to load: "
        "ImportError: libacme.so: cannot open shared object file"
    )
    with pytest.raises(PluginLoadError, match="^" + expected.replace("(", r"\(").replace(")", r"\)")):
        reg.select("acme")
    # auto must not fall back to cpu past a broken plugin ...
    with pytest.raises(PluginLoadError, match="plugin 'acme'.*ImportError.*name a device with --device"):
        reg.select("auto")
    # ... while naming another device works, and says the plugin is broken.
    with caplog.at_level(logging.WARNING):
        assert reg.select("cpu").name == "cpu"
    assert expected in caplog.text


def test_entry_point_must_make_a_platform_of_its_own_name():
    reg = registry(
        EntryPoint("cpu", make_platform("cpu")),
        EntryPoint("notaplatform", lambda: object()),
        EntryPoint("misnamed", make_platform("other")),
    )
    assert set(reg.broken) == {"notaplatform", "misnamed"}
    assert "not an omnirun.Platform" in reg.broken["notaplatform"].error
    assert "names a platform called 'other'" in reg.broken["misnamed"].error


@pytest.mark.parametrize("version", [0, 99])
def test_plugin_for_an_unsupported_api_version_is_kept_as_broken_naming_the_supported_ones(version):
    other = make_platform("other")
    other.api_version = version
    reg = registry(EntryPoint("cpu", make_platform("cpu")), EntryPoint("other", other, Dist("other-omnirun", "0.1")))
    assert "other" in reg.broken and "other" not in reg.platforms and "other" in reg.names()
    message = reg.broken["other"].message()
    assert "\n" not in message
    assert f"platform API version {version}" in message
    assert f"supports versions {', '.join(map(str, SUPPORTED_API_VERSIONS))}" in message
    assert "install a release of the plugin made for one of them" in message
    with pytest.raises(PluginLoadError, match="other-omnirun 0.1"):
        reg.select("other")


def test_plugin_for_the_previous_api_version_loads_with_one_deprecation_warning():
    previous = make_platform("previous")
    previous.api_version = PLATFORM_API_VERSION - 1
    with pytest.warns(OmnirunDeprecationWarning, match="version 1, which this omnirun still loads") as caught:
        reg = registry(EntryPoint("cpu", make_platform("cpu")), EntryPoint("previous", previous))
        registry(EntryPoint("previous", previous))  # discovered again in the process: no second warning
    assert len(caught) == 1 and "previous" in reg.platforms


@pytest.mark.parametrize(
    "missing",
    [
        ["api_version"],
        ["name"],
        ["torch_device_type"],
        ["distributed_backend"],
        ["_probe"],
        ["_capabilities"],
        ["api_version", "_capabilities"],
    ],
)
def test_plugin_lacking_a_required_attribute_is_kept_as_broken_naming_what_is_missing(missing):
    base = make_platform("lacking")
    attrs = {name: getattr(Platform, name, None) for name in missing}  # back to what the base class provides
    lacking = type("Lacking", (base,), {k: v for k, v in attrs.items() if v is not None})
    for name in missing:
        if attrs[name] is None:  # an annotation only on Platform: remove the subclass's value
            setattr(lacking, name, None)
    reg = registry(EntryPoint("cpu", make_platform("cpu")), EntryPoint("lacking", lacking))
    assert set(reg.broken) == {"lacking"} and "lacking" in reg.names()
    error = reg.broken["lacking"].error
    assert "\n" not in error and error.startswith("TypeError: Lacking does not set ")
    named = error.split(" does not set ", 1)[1].split(":", 1)[0].split(", ")
    assert named == [f"{name}()" if name.startswith("_") else name for name in missing]
    assert "implements _probe() and _capabilities()" in error  # the fix


def test_in_tree_platforms_meet_the_contract():
    from omnirun.registry import check_contract, default_registry

    for platform in default_registry().platforms.values():
        check_contract(platform)
        assert type(platform).api_version == PLATFORM_API_VERSION


def test_two_packages_claiming_one_name_is_an_error():
    with pytest.raises(DuplicatePlatformError, match="'npu': vendor-a 1.0 .* and vendor-b 2.0 .*uninstall one"):
        registry(
            EntryPoint("npu", make_platform("npu"), Dist("vendor-a", "1.0")),
            EntryPoint("npu", make_platform("npu"), Dist("vendor-b", "2.0")),
        )


def test_nothing_registered_says_to_install_the_package():
    with pytest.raises(OmnirunError, match=r"pip install -e \."):
        registry()


def test_auto_with_nothing_available_gives_every_reason():
    reg = registry(EntryPoint("a", make_platform("a", available=False, reason="no driver")))
    with pytest.raises(DeviceUnavailableError, match=r"no platform is available \(a: no driver\)"):
        reg.select("auto")


def test_probe_never_raises_and_folds_multiline_reasons():
    class Exploding(make_platform("boom")):
        def _probe(self) -> ProbeResult:
            raise RuntimeError("driver\nexploded")

    class Chatty(make_platform("chatty")):
        def _probe(self) -> ProbeResult:
            return ProbeResult.unavailable("line one\n  line two")

    assert Exploding().probe() == ProbeResult(False, "probing boom raised RuntimeError: driver exploded", 0)
    assert Chatty().probe().reason == "line one line two"
    with pytest.raises(DeviceUnavailableError):
        _ = Exploding().capabilities


def test_in_tree_platforms_all_register():
    from omnirun.registry import default_registry

    reg = default_registry()
    assert {"cpu", "cuda", "rocm", "npu", "xpu"} <= set(reg.platforms), reg.broken
    assert reg.names()[-1] == "cpu"


def test_registry_hooks_run_in_name_order_and_may_replace_a_platform():
    reg = registry(EntryPoint("cpu", make_platform("cpu")), EntryPoint("gpu", make_platform("gpu")))
    tuned = make_platform("gpu", priority=99)()
    calls = []

    def first(r):
        calls.append("a")
        r.register(tuned)

    reg.run_hooks([EntryPoint("b-hook", lambda r: calls.append("b")), EntryPoint("a-hook", first)])
    assert calls == ["a", "b"]
    assert reg.get("gpu") is tuned and reg.names()[0] == "gpu"


def test_a_hook_registers_only_a_platform_that_meets_the_contract():
    stale = make_platform("cpu")
    stale.api_version = 0
    reg = registry(EntryPoint("cpu", make_platform("cpu")))
    with pytest.raises(PluginLoadError, match=r"registry hook 'site' from vendor-pkg 1.0 .*versions 1, 2"):
        reg.run_hooks([EntryPoint("site", lambda r: r.register(stale()))])


def test_a_failing_hook_stops_discovery_naming_the_hook():
    reg = registry(EntryPoint("cpu", make_platform("cpu")))
    with pytest.raises(PluginLoadError, match=r"registry hook 'site' .*ImportError: no tuned_gpu.*uninstall"):
        reg.run_hooks([EntryPoint("site", ImportError("no tuned_gpu"))])
