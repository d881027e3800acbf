"""Test-only fakes, never installed with omnirun: `device` (a graph that records and replays, the host standing in
for a device) and `lane` (how a fake vendor lane reaches every process a test starts). pytest finds this folder
through `pythonpath` in pyproject.toml; `ci/run-lane` puts it on PYTHONPATH for a fake lane's child processes."""
