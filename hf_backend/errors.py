"""The one exception type users see from hf_backend: a one-line message that names the thing and the
fix."""


class HfBackendError(RuntimeError):
    """Raised for misuse and bad input; the message says what is wrong and what to do instead."""
