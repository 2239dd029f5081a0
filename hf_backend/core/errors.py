"""The one exception type users see from hf_backend: a one-line message that names the thing and the
fix."""


class HfBackendError(RuntimeError):
    """Raised for misuse and bad input; the message says what is wrong and what to do instead."""


class ConfigError(HfBackendError, ValueError):
    """A config file or setting is wrong; the message is one line naming the file, the key and the fix."""
