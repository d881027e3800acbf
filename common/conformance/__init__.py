"""The conformance suite every device must pass, shipped inside omnirun so that an installed device plugin can be
certified without this repository:

    pytest --pyargs omnirun.conformance --device mydev        # or: python -m omnirun.conformance --device mydev

It checks the platform's contract (probe, capabilities, device control, memory probe, collectives at world sizes
1 and 2), every attention backend it offers against torch_native, every fused op against its torch-native reference,
graph replay against eager, end-to-end logits and greedy tokens against HF transformers, weight updates, and the
engine and LLM API (continuous batching under memory pressure, threads, streams, aborts, lifecycle). A part the
device does not offer (no graphs, no backend besides torch_native) is skipped with the reason. Tests marked `slow`
(soaks) can be deselected with `-m "not slow"`. The pytest plugin (`omnirun.conformance.plugin`, registered
through the `pytest11` entry point) adds `--device` and the fixtures.
"""
