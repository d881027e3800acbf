"""An example omnirun device plugin (see platform.py)."""
