"""Triton kernels, portable to every device whose capabilities say `supports_triton` (see `omnirun.kernels`).

Each module imports triton: only the gate in `omnirun.kernels` and the attention registry import them, lazily.
"""
