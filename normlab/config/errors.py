"""The one error a run configuration raises: ConfigError, whose message is one line."""


class ConfigError(ValueError):
    """A run configuration that cannot be trained; the message is one line."""
