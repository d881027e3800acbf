"""Intel GPUs as an omnirun device, through torch's own torch.xpu; intel-extension-for-pytorch is not used."""
