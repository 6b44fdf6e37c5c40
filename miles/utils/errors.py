"""The base of every error that explains itself.

``miles.spmd.errors.run_main`` prints a ``MilesError`` (and a ``ConfigError``) as ONE line naming the
rank, with no traceback. Planes derive their user-facing errors from it (together with the builtin
they stand for, e.g. ``class DataError(MilesError, ValueError)``), so a failure on any rank reads the
same way.
"""

from __future__ import annotations


class MilesError(RuntimeError):
    """A known failure at run time whose message says what happened and what to do."""


class DataError(MilesError, ValueError):
    """Input data is malformed (a prompt file, a conversation); the message names the file, the line (or row) and
    the fix. ``miles.rollout.data`` re-exports it."""
