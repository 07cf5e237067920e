"""Errors a user can cause. Each carries one line that names the field and the fix; entry points print it
without a traceback and exit with code `EXIT_USER_ERROR`."""

EXIT_USER_ERROR = 2


class UserError(ValueError):
    """Base class for mistakes in configs, data, launch environment or checkpoints."""


class ConfigError(UserError):
    """A config field has a bad value."""


class LayoutError(ConfigError):
    """The parallel layout does not fit the world size or the model."""


class DataError(UserError):
    """Bad data config, missing or empty data files, or a tokenizer that does not fit the model."""
