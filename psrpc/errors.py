"""User-facing errors: raised for bad input, printed as one line, never as a traceback wall.

A rank started by torchrun, srun or a Kubernetes engine ends with an exit code its engine can
act on: EXIT_USER (2) for what starting it again cannot cure (a bad config, missing data, a
corrupt checkpoint), EXIT_RETRY (138) where this rank lost the run, not its input (the chief, a
peer or the network went away): started again, it rejoins the live run. 138 is one of the codes
Kubeflow's training operator retries under its ExitCode restart policy (130, 137, 138, 143).
"""

EXIT_USER = 2
EXIT_RETRY = 138


class PsrpcError(Exception):
    """An error the user can fix: the message names the key, path or value and what would be right."""


class Retryable(PsrpcError):
    """This rank lost the run (the chief, a peer or the network went away), not its input:
    started again, it rejoins the live run (EXIT_RETRY)."""


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


def exit_code(e: BaseException) -> int:
    """The code a rank that ends with `e` exits with (the module's docstring)."""
    return EXIT_RETRY if isinstance(e, Retryable) or network_failure(e) else EXIT_USER


def network_failure(e: BaseException) -> bool:
    """Whether an error is a call that failed on the network (a timeout, a peer gone), not a
    bug: said in one line, not a traceback."""
    return not isinstance(e, PsrpcError) and any(m in str(e) for m in NETWORK_MARKS)
