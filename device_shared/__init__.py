"""Vendor glue that two or more device packages share: torch's GPU build behind torch.cuda (torch_gpu: cuda and
rocm) and intel-extension-for-pytorch (ipex_*: xpu and cpu).

It names vendors, so it is not in common/ (`omnirun`, device-neutral); it is not a device either: it has no
platform.py and registers nothing. Device packages may import it, never one another; it imports no device package.
"""
