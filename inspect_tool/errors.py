"""Error types raised by the library; the CLI maps each to a one-line message and an exit code.

`InputError` (and subclasses) means the user's input is bad: exit code 2. Every message names the bad
value and what would be accepted.
"""

from __future__ import annotations

import difflib


class InspectError(Exception):
  """Base class of every error the library raises on purpose."""

  exit_code = 2


class InputError(InspectError):
  """Bad user input: a key, a value, a path, a file's contents."""


class ConfigError(InputError):
  """A configuration key or value is not acceptable."""


class UnknownKeyError(ConfigError):
  """A key that the configuration does not know, with the closest known keys suggested."""

  def __init__(self, key: str, known: list[str] | tuple[str, ...], what: str = "config key"):
    close = difflib.get_close_matches(key, known, n=3, cutoff=0.6)
    hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    super().__init__(f"unknown {what} {key!r}{hint}")
    self.key = key
    self.suggestions = close


class CheckpointError(InputError):
  """A checkpoint path is missing, unreadable or not what was expected."""


class MismatchError(InputError):
  """Weights in a checkpoint do not fit the model: names the missing and mis-shaped weights."""
