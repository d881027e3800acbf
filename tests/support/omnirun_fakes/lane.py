"""How a fake lane reaches every process a test starts (ranks, servers, CLIs): the way a site's package would, through
an entry point of omnirun's `omnirun.registry_hooks` group. The lane's distribution is never installed: it is a
`.dist-info` folder written into a scratch folder that only this run's PYTHONPATH names, so a child process finds it
by inheriting the environment and nothing outlives the run.

A lane file (`devices/<x>/tests/fake_lane.py`) defines `install(registry)`: it puts the fake vendor modules in place
and `registry.register()`s the fake platform.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

SUPPORT = Path(__file__).resolve().parent.parent  # tests/support: where omnirun_fakes is imported from
DIST_INFO = "omnirun_fake_lane-0.dist-info"


def fake_lane_environment(lane_file: Path, scratch: Path, env: Mapping[str, str] = os.environ) -> dict[str, str]:
    """`env` with the fake lane of `lane_file` switched on: a distribution in `scratch` whose registry hook is the
    lane file's `install`, and PYTHONPATH naming it, this package and the lane file's folder."""
    lane_file = Path(lane_file).resolve()
    if not lane_file.is_file():
        raise FileNotFoundError(f"{lane_file} is no file: give the path of a fake_lane.py")
    dist = Path(scratch) / DIST_INFO
    dist.mkdir(parents=True, exist_ok=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: omnirun-fake-lane\nVersion: 0\n")
    (dist / "entry_points.txt").write_text(f"[omnirun.registry_hooks]\nfake-lane = {lane_file.stem}:install\n")
    path = [str(scratch), str(SUPPORT), str(lane_file.parent), env.get("PYTHONPATH", "")]
    return {**env, "PYTHONPATH": os.pathsep.join(filter(None, path))}


def without_fake_lane(env: Mapping[str, str] = os.environ) -> dict[str, str]:
    """`env` with the fake lane switched off, for a child that tests the real platform: PYTHONPATH loses the folder
    that holds the lane's distribution."""
    path = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and not (Path(p) / DIST_INFO).is_dir()]
    result = {k: v for k, v in env.items() if k != "PYTHONPATH"}
    if path:
        result["PYTHONPATH"] = os.pathsep.join(path)
    return result
