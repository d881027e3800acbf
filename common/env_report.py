"""`omnirun env`: what every known platform can do on this machine, as a table or as JSON."""

from __future__ import annotations

import dataclasses
import json
import platform as _host

import torch

from omnirun.platform import Platform
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
    return row


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


def to_table(rows: list[PlatformRow], selected: str | None) -> str:
    columns = ["PLATFORM", "DEVICES", "MEMORY FREE/TOTAL", "DIST", "ATTENTION", "FUSED OPS", "GRAPHS", "PACKAGES"]
    columns.append("STATUS")
    body = [_cells(r) for r in rows]
    widths = [max(len(c), *(len(b[i]) for b in body)) for i, c in enumerate(columns[:-1])]
    lines = [" · ".join(f"{k} {v}" for k, v in header().items())]
    lines.append(f"auto selects: {selected or 'nothing (see STATUS)'}")
    lines.append("")
    for cells in [columns, *body]:
        # STATUS goes last and unpadded: a reason can be long.
        lines.append("  ".join(c.ljust(w) for c, w in zip(cells[:-1], widths, strict=True)) + "  " + cells[-1])
    return "\n".join(lines)


def _cells(row: PlatformRow) -> list[str]:
    memory = "-"
    if row.memory_total:
        memory = f"{row.memory_free / _GIB:.1f}/{row.memory_total / _GIB:.1f} GiB"
    devices = str(row.device_count) if row.status == "available" else "-"
    if row.device_name:
        devices += f" × {row.device_name}"
    packages = ", ".join(f"{k} {v or '-'}" for k, v in row.packages.items()) or "-"
    status = row.status + (f": {row.reason}" if row.reason else "")
    if row.notes:
        status += f" ({'; '.join(row.notes)})"
    return [
        row.name,
        devices,
        memory,
        row.distributed_backend or "-",
        ",".join(row.attention_backends) or "-",
        ",".join(row.fused_ops) or "-",
        row.graph_capture or "-",
        packages,
        status,
    ]
