"""Errors the command line turns into one clear line and an exit code, never a traceback."""


class LlmqError(Exception):
    """A user-facing failure: bad input, a missing file, an impossible option. Exit code 2."""

    exit_code = 2


class GateFailed(LlmqError):
    """A quality gate did not hold. Exit code 1, so CI pipelines can tell it from bad input."""

    exit_code = 1
