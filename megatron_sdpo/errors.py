"""User-facing errors: one line, no traceback, non-zero exit (see cli.main)."""


class UserError(Exception):
    """A mistake in the user's input (config, data, paths). The CLI prints `error: <msg>`."""


class Stopped(Exception):
    """A signal asked a command to stop after saving what it had; the CLI prints the message and
    exits with 128 + the signal's number, as the signal's default action would have."""

    def __init__(self, signum: int, message: str):
        self.signum = signum
        super().__init__(message)


class ConfigError(UserError):
    """Unknown key, wrong type or invalid value in a config; the message names the key."""


class DataError(UserError):
    """Malformed or missing data; the message names the file and, where known, the line."""


class CheckpointError(UserError):
    """Missing, partial or corrupt checkpoint."""


class MissingDependencyError(UserError):
    """An optional dependency is absent; the message names the extra that installs it."""


def require(module: str, extra: str, what: str = ""):
    """Import `module` or raise MissingDependencyError naming `pip install megatron_sdpo[extra]`."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:  # pragma: no cover - depends on the environment
        purpose = f" for {what}" if what else ""
        raise MissingDependencyError(
            f"{module} is needed{purpose} but is not installed ({exc}); install it with `pip install -e .[{extra}]`"
        ) from None


class RefitError(UserError):
    """The rollout engine's weights disagree with the trainer's (the refit guard tripped)."""
