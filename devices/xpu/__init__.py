"""Intel GPUs as an omnirun device, through torch's own torch.xpu; IPEX parts where a matching IPEX is installed."""
