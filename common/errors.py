"""Errors a user can act on: each message is one line that names the fix."""


class OmnirunError(Exception):
    """Base of every error omnirun raises on bad input or an unusable setup."""


class DeviceUnavailableError(OmnirunError):
    """The named device cannot be used here; the message carries the probe's reason."""

    def __init__(self, device: str, reason: str):
        self.device = device
        self.reason = reason
        super().__init__(f"device '{device}' is unavailable: {reason}")


class UnknownDeviceError(OmnirunError):
    """No platform registered under that name."""


class PluginLoadError(OmnirunError):
    """A platform plugin raised while loading, or did not provide a Platform."""


class DuplicatePlatformError(OmnirunError):
    """Two installed packages register a platform under the same name."""


class ConfigError(OmnirunError):
    """A runner flag has a bad value or flags contradict each other."""


class ModelLoadError(OmnirunError):
    """A model directory, config or checkpoint cannot be loaded."""


class UnsupportedModelError(OmnirunError):
    """The checkpoint's architecture (or one of its features) is not implemented."""


class KVPoolTooSmallError(OmnirunError):
    """The memory left for the KV cache cannot hold one request of the context length."""


class SamplingParamsError(OmnirunError):
    """A sampling parameter is out of range."""


class StructuredOutputError(OmnirunError, ValueError):
    """A structured-output constraint that cannot be compiled (a bad schema, regex or grammar), or no backend to
    compile it."""


class WeightUpdateError(OmnirunError):
    """A weight update was refused or failed; the previous weights are still in place."""


class EngineStepError(OmnirunError):
    """A step of the engine raised; the requests it held were ended and the engine takes new ones."""


class EngineClosedError(OmnirunError):
    """The LLM (or its engine loop) was closed, or its engine thread died."""


class DistributedInitError(OmnirunError):
    """Joining the process group failed: flags that do not fit together, or peers that never joined in time."""


class WorkerError(OmnirunError):
    """A tensor-parallel rank failed or died; the whole group is unusable and has been shut down."""
