"""The one way a ``guard`` command fails: :class:`GuardError`, mapped to an exit code once.

A failure is reported in one line that says what was wrong and what to do next, without a
traceback. The exit codes (``guard --help`` lists them): 2 for a usage error (argparse's own,
or a bad option value found after parsing), 1 for a runtime failure, 130 when interrupted.
The base modules' errors (``BrokerUnreachable``, ``StoreUnavailable``, ``EmbeddedBrokerError``,
``ConfigError``) are subclasses.
"""

from __future__ import annotations

__all__ = ["EXIT_FAILURE", "EXIT_INTERRUPTED", "EXIT_USAGE", "GuardError", "UsageError"]

EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


class GuardError(RuntimeError):
    """A failure to report in one line: what was wrong and what to do next."""

    exit_code = EXIT_FAILURE


class UsageError(GuardError):
    """A command-line value that parsed but cannot be used (exit code 2, like argparse)."""

    exit_code = EXIT_USAGE
