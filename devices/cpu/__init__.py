"""The host CPU as an omnirun device: always available, the reference lane."""
