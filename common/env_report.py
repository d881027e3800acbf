"""`omnirun env`: what every known platform can do on this machine, as a table or as JSON."""

from __future__ import annotations

import dataclasses
import json
import platform as _host
import textwrap

import torch

from omnirun.assembly import assemble, deterministic_linear
from omnirun.config import RunnerConfig
from omnirun.memory.sizing import DEFAULT_RUNNING_REQUESTS
from omnirun.platform import Platform
from omnirun.quantization.formats import loading_summary
from omnirun.registry import PlatformRegistry

_GIB = 1 << 30


@dataclasses.dataclass
class PlatformRow:
    name: str
    status: str  # "available", "unavailable" or "broken"
    reason: str
    device_count: int
    device_name: str | None
    memory_free: int | None
    memory_total: int | None
    distributed_backend: str | None
    attention_backends: list[str]
    fused_ops: list[str]
    graph_capture: str | None
    packages: dict[str, str | None]
    notes: list[str] = dataclasses.field(default_factory=list)  # vendor parts fallen back from, and why
    # What --deterministic builds: its attention backends (the first is the default) and its linear layers.
    deterministic: str | None = None
    # What a run with the default flags builds for a model in the device's best dtype (omnirun.assembly).
    default_run: str | None = None
    quantized: str | None = None  # how quantized checkpoints load (omnirun.quantization)


def platform_row(platform: Platform) -> PlatformRow:
    """Facts of one platform. Only an available platform is touched beyond its cheap probe. Backends, fused ops
    and graphs are what the platform builds (its answers to the runner), not labels of their own."""
    probe = platform.probe()
    row = PlatformRow(
        name=platform.name,
        status="available" if probe.available else "unavailable",
        reason=probe.reason,
        device_count=probe.device_count,
        device_name=None,
        memory_free=None,
        memory_total=None,
        distributed_backend=platform.distributed_backend,
        attention_backends=[],
        fused_ops=[],
        graph_capture=None,
        packages=platform.package_versions(),
        notes=list(platform.notes()),
    )
    if probe.available:
        caps = platform.capabilities
        row.device_name = caps.device_name
        row.memory_free, row.memory_total = platform.memory_info(0)
        row.attention_backends = list(platform.attention_backends())
        row.fused_ops = sorted(platform.fused_ops())
        graph_api = platform.graph_api()
        row.graph_capture = graph_api.name if graph_api is not None else None
        row.deterministic = (
            f"attention {', '.join(platform.deterministic_attention_backends())}; linear "
            + deterministic_linear(platform)
        )
        row.default_run = default_run(platform)
        ops = row.fused_ops
        row.quantized = loading_summary(
            "fp8_linear" in ops, "int4_linear" in ops, "fp8_fused_moe" in ops, "int4_fused_moe" in ops
        )
    return row


def default_run(platform: Platform) -> str:
    """What a run with the default flags builds on `platform` for a model in its best dtype, as the runner decides
    it (`omnirun.assembly.assemble`)."""
    dtype = platform.capabilities.model_dtypes[0]
    assembly = assemble(RunnerConfig(model="-"), platform, dtype, DEFAULT_RUNNING_REQUESTS[1])
    return f"{str(dtype).removeprefix('torch.')}: {assembly.summary()}"


def collect(registry: PlatformRegistry, only: str | None = None) -> list[PlatformRow]:
    rows = []
    for name in registry.names():
        if only is not None and name != only:
            continue
        if name in registry.broken:
            broken = registry.broken[name]
            rows.append(PlatformRow(name, "broken", broken.message(), 0, None, None, None, None, [], [], None, {}))
        else:
            rows.append(platform_row(registry.platforms[name]))
    return rows


def header() -> dict[str, str]:
    from omnirun import __version__

    return {"omnirun": __version__, "torch": torch.__version__, "python": _host.python_version()}


def to_json(rows: list[PlatformRow], selected: str | None) -> str:
    return json.dumps(
        {**header(), "selected": selected, "platforms": [dataclasses.asdict(r) for r in rows]},
        indent=2,
    )


WIDTH = 100  # columns of the text report: it reads in a 100-column terminal
_LABEL = 12  # width of a field's label column


def to_table(rows: list[PlatformRow], selected: str | None) -> str:
    """The text report: a header, then one block per platform, every line at most WIDTH columns."""
    lines = _wrap("", " · ".join(f"{k} {v}" for k, v in header().items()))
    lines += _wrap("auto selects: ", selected or "nothing (every platform says why below)")
    for row in rows:
        lines.append("")
        lines.extend(_block(row))
    return "\n".join(lines)


def _wrap(first: str, text: str) -> list[str]:
    """`text` after `first`, wrapped to WIDTH with the continuation lines under the text's start."""
    indent = " " * len(first)
    wrapped = textwrap.wrap(text, WIDTH, initial_indent=first, subsequent_indent=indent, break_on_hyphens=False)
    return wrapped or [first.rstrip()]


def _block(row: PlatformRow) -> list[str]:
    status = row.status + (f": {row.reason}" if row.reason else "")
    lines = _wrap(f"{row.name}  ", status)
    for label, value in _fields(row):
        lines.extend(_wrap(f"  {label:<{_LABEL}}", value))
    return lines


def _fields(row: PlatformRow) -> list[tuple[str, str]]:
    """(label, value) of what the report shows of one platform: the device's facts only where it is available."""
    fields = []
    if row.status == "available":
        devices = str(row.device_count) + (f" × {row.device_name}" if row.device_name else "")
        memory = "-"
        if row.memory_total:
            memory = f"{row.memory_free / _GIB:.1f} GiB free of {row.memory_total / _GIB:.1f} GiB"
        fields += [
            ("devices", devices),
            ("memory", memory),
            ("attention", ", ".join(row.attention_backends) or "-"),
            ("fused ops", ", ".join(row.fused_ops) or "-"),
            ("graphs", row.graph_capture or "-"),
            ("determinism", row.deterministic or "-"),
            ("default run", row.default_run or "-"),
            ("quantized", row.quantized or "-"),
        ]
    if row.distributed_backend:
        fields.append(("dist", row.distributed_backend))
    if row.packages:
        fields.append(("packages", ", ".join(f"{k} {v or '-'}" for k, v in row.packages.items())))
    if row.notes:
        fields.append(("notes", "; ".join(row.notes)))
    return fields
