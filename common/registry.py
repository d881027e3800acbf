"""Discovery and selection of platforms.

Every platform, the in-tree ones included, registers through the `omnirun.platforms` entry-point group, so an
out-of-tree vendor package is a first-class citizen: `pip install` it and `--device <its name>` works.

Selection order: an explicit `--device`, else the `OMNIRUN_DEVICE` environment variable, else `auto`, which picks
the available platform with the highest `auto_priority` (cuda = rocm > npu > xpu > plugins > cpu).

After discovery, every entry point of the `omnirun.registry_hooks` group is called with the registry, once per
process: a site's package can put a subclass of a platform in place of the one registered (tuned defaults, a
patched probe) in every process omnirun starts, servers and ranks included. Our fake vendor lanes install their
fakes this way, from test code only.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import logging
import os
import warnings
from collections.abc import Iterable

from omnirun.errors import (
    DeviceUnavailableError,
    DuplicatePlatformError,
    OmnirunError,
    PluginLoadError,
    UnknownDeviceError,
)
from omnirun.facts import PLATFORM_API_VERSION, SUPPORTED_API_VERSIONS
from omnirun.platform import Platform

ENTRY_POINT_GROUP = "omnirun.platforms"
HOOK_GROUP = "omnirun.registry_hooks"
DEVICE_ENV_VAR = "OMNIRUN_DEVICE"
AUTO = "auto"

# What every platform must set or implement; the Platform base class provides everything else.
REQUIRED_ATTRIBUTES = ("api_version", "name", "torch_device_type", "distributed_backend")
REQUIRED_METHODS = ("_probe", "_capabilities")

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class BrokenPlugin:
    """A registered platform that raised on load, did not provide a Platform, or broke the contract."""

    name: str
    source: str  # "distribution version (module:attr)"
    error: str  # "ExceptionType: message"

    def message(self) -> str:
        return f"platform plugin '{self.name}' from {self.source} failed to load: {self.error}"


class PlatformRegistry:
    """The platforms installed in this environment, by name."""

    def __init__(self, platforms: dict[str, Platform], broken: dict[str, BrokenPlugin] | None = None):
        self.platforms = platforms
        self.broken = broken or {}

    @classmethod
    def discover(cls, entry_points: Iterable[importlib.metadata.EntryPoint] | None = None) -> PlatformRegistry:
        """Load every entry point of the group. A plugin that raises is kept as broken, never dropped."""
        if entry_points is None:
            entry_points = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
        entry_points = list(entry_points)
        _reject_duplicates(entry_points)
        platforms: dict[str, Platform] = {}
        broken: dict[str, BrokenPlugin] = {}
        for ep in entry_points:
            try:
                platforms[ep.name] = _load_platform(ep)
            except Exception as exc:
                broken[ep.name] = BrokenPlugin(ep.name, _source(ep), f"{type(exc).__name__}: {exc}")
        if not platforms and not broken:
            raise OmnirunError(
                f"no platform is registered in the '{ENTRY_POINT_GROUP}' entry-point group: "
                "install omnirun as a package (pip install -e .) rather than running it from the source tree"
            )
        return cls(platforms, broken)

    def register(self, platform: Platform) -> None:
        """Add `platform` under its name, in place of the one registered there (a registry hook's tool); it must
        meet the contract like a discovered one."""
        check_contract(platform)
        self.platforms[platform.name] = platform
        self.broken.pop(platform.name, None)

    def run_hooks(self, entry_points: Iterable[importlib.metadata.EntryPoint] | None = None) -> None:
        """Call each `omnirun.registry_hooks` entry point with this registry, in name order. A hook that fails
        stops discovery: running on without it would run on platforms the site meant to replace."""
        if entry_points is None:
            entry_points = importlib.metadata.entry_points(group=HOOK_GROUP)
        for ep in sorted(entry_points, key=lambda ep: ep.name):
            try:
                ep.load()(self)
            except Exception as exc:
                raise PluginLoadError(
                    f"registry hook '{ep.name}' from {_source(ep)} failed: {type(exc).__name__}: {exc}; "
                    "fix or uninstall the package that provides it"
                ) from exc

    def names(self) -> list[str]:
        """Every registered name, broken plugins included, in auto-selection order."""
        ranked = sorted(self.platforms.values(), key=lambda p: (-p.auto_priority, p.name))
        return [p.name for p in ranked] + sorted(self.broken)

    def get(self, name: str, origin: str = "") -> Platform:
        """The platform registered as `name`; `origin` says where the name came from, for the error."""
        if name in self.platforms:
            return self.platforms[name]
        if name in self.broken:
            raise PluginLoadError(self.broken[name].message())
        raise UnknownDeviceError(
            f"unknown device '{name}'{origin}: choose one of {', '.join(self.names() + [AUTO])}, "
            "or install the plugin package that provides it"
        )

    def select(self, device: str | None = None) -> Platform:
        """The platform for --device (or OMNIRUN_DEVICE, or auto); raises with the reason if unusable."""
        from_env = not device and bool(os.environ.get(DEVICE_ENV_VAR))
        requested = (device or os.environ.get(DEVICE_ENV_VAR) or AUTO).strip().lower()
        if requested != AUTO:
            platform = self.get(requested, origin=f" (from {DEVICE_ENV_VAR})" if from_env else "")
            platform.require_available()
            for plugin in self.broken.values():  # not in the way, but never silent
                logger.warning(plugin.message())
            return platform
        if self.broken:
            # auto must not quietly fall back past a plugin the user installed for a reason.
            broken = "; ".join(b.message() for b in self.broken.values())
            raise PluginLoadError(f"{broken} — fix or uninstall it, or name a device with --device")
        reasons = []
        for name in self.names():
            probe = self.platforms[name].probe()
            if probe.available:
                return self.platforms[name]
            reasons.append(f"{name}: {probe.reason}")
        raise DeviceUnavailableError(AUTO, "no platform is available (" + "; ".join(reasons) + ")")


def _load_platform(ep: importlib.metadata.EntryPoint) -> Platform:
    factory = ep.load()
    platform = factory()
    if not isinstance(platform, Platform):
        raise TypeError(f"{ep.value} made a {type(platform).__name__}, not an omnirun.Platform")
    check_contract(platform)
    if platform.name != ep.name:
        raise ValueError(f"entry point '{ep.name}' names a platform called '{platform.name}'; the two must match")
    return platform


class OmnirunDeprecationWarning(FutureWarning):
    """A plugin uses a hook of an older contract version. A FutureWarning, which Python shows by default (a
    DeprecationWarning is hidden outside __main__), without touching the process's warning filters."""


_warned: set[type] = set()  # platform classes already warned about (once each per process)


def check_contract(platform: Platform) -> None:
    """Raise, in one line naming the fix, if `platform` lacks a required attribute or was written for another
    version of the Platform contract."""
    cls = type(platform)
    missing = [name for name in REQUIRED_ATTRIBUTES if getattr(cls, name, None) in (None, "")]
    missing += [f"{name}()" for name in REQUIRED_METHODS if getattr(cls, name) is getattr(Platform, name)]
    if missing:
        raise TypeError(
            f"{cls.__name__} does not set {', '.join(missing)}: every Platform sets api_version = "
            f"{PLATFORM_API_VERSION}, name, torch_device_type and distributed_backend, and implements _probe() "
            "and _capabilities()"
        )
    if cls.api_version not in SUPPORTED_API_VERSIONS:
        supported = ", ".join(map(str, SUPPORTED_API_VERSIONS))
        raise TypeError(
            f"{cls.__name__} was written for omnirun platform API version {cls.api_version!r}, and this omnirun "
            f"supports versions {supported}: install a release of the plugin made for one of them, or an omnirun "
            f"that supports version {cls.api_version!r}"
        )
    if cls.api_version != PLATFORM_API_VERSION:
        # Once per class: discovery runs once per process, but tests and tools may check a platform again.
        if cls not in _warned:
            _warned.add(cls)
            warnings.warn(
                f"{cls.__name__} was written for omnirun platform API version {cls.api_version}, which this omnirun "
                f"still loads through shims; move it to version {PLATFORM_API_VERSION} (docs/platform-contract.md "
                "lists what changed): attention_offers() in place of attention_backend_factories() and "
                "default_attention_backend(), no make_graph_runner(runner)",
                OmnirunDeprecationWarning,
                stacklevel=2,
            )


def _source(ep: importlib.metadata.EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    owner = f"{dist.name} {dist.version}" if dist is not None else "an unknown distribution"
    return f"{owner} ({ep.value})"


def _reject_duplicates(entry_points: list[importlib.metadata.EntryPoint]) -> None:
    seen: dict[str, importlib.metadata.EntryPoint] = {}
    for ep in entry_points:
        if ep.name in seen:
            raise DuplicatePlatformError(
                f"two packages register platform '{ep.name}': {_source(seen[ep.name])} and {_source(ep)}; "
                "uninstall one of them"
            )
        seen[ep.name] = ep


_default_registry: PlatformRegistry | None = None


def default_registry() -> PlatformRegistry:
    """The registry of this Python environment, discovered and its hooks run once per process."""
    global _default_registry
    if _default_registry is None:
        registry = PlatformRegistry.discover()
        registry.run_hooks()
        _default_registry = registry
    return _default_registry


def get_platform(name: str) -> Platform:
    return default_registry().get(name)


def select_platform(device: str | None = None) -> Platform:
    return default_registry().select(device)
