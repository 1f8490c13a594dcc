"""User-facing errors: raised for bad input, printed as one line, never as a traceback wall."""


class PsrpcError(Exception):
    """An error the user can fix: the message names the key, path or value and what would be right."""


class ConfigError(PsrpcError, ValueError):
    """A config value is out of range or inconsistent with another one."""


class PushRejected(PsrpcError):
    """A push that a shard refuses (wrong length, dtype, unknown worker, step from the future)."""


class TablesExportError(PsrpcError):
    """An out_dir's tables/ folder that does not hold exactly the files of one finished export:
    a file missing, one from another run, or a table's rows missing or held by two files."""


def require(ok: bool, key: str, value, allowed: str) -> None:
    """Raise a ConfigError naming the key, its value and what is allowed, unless `ok`."""
    if not ok:
        raise ConfigError(f"{key}={value!r}: {allowed}")


def one_of(choices, name, key: str):
    """`choices[name]` from a registry (a dict), or `name` itself from a tuple of names; else a
    ConfigError naming the key, the value and the valid names."""
    if name in choices:
        return choices[name] if isinstance(choices, dict) else name
    valid = sorted(choices) if isinstance(choices, dict) else list(choices)
    raise ConfigError(f"{key}={name!r}: must be one of {valid}")


def first_line(e: BaseException) -> str:
    """The first line of an error's message (a remote error carries its traceback), or its
    type's name when it has none."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


NETWORK_MARKS = ("RPCErr", "tensorpipe", "ECONNRESET", "ECONNREFUSED", "EPIPE", "timed out",
                 "Connection reset", "Connection refused")


def network_failure(e: BaseException) -> bool:
    """Whether an error is a call that failed on the network (a timeout, a peer gone), not a
    bug: said in one line, not a traceback."""
    return not isinstance(e, PsrpcError) and any(m in str(e) for m in NETWORK_MARKS)
