"""User-facing errors: raised for bad input, printed as one line, never as a traceback wall."""


class PsrpcError(Exception):
    """An error the user can fix: the message names the key, path or value and what would be right."""


class ConfigError(PsrpcError):
    """A config value is out of range or inconsistent with another one."""


class PushRejected(PsrpcError):
    """A push that a shard refuses (wrong length, dtype, unknown worker, step from the future)."""
