"""Error types raised by the library; the CLI maps each to a one-line message and an exit code.

`InputError` (and subclasses) means the user's input is bad: exit code 2. Every message names the bad
value and what would be accepted.
"""

from __future__ import annotations

import difflib
import inspect
import logging
import signal
import sys
import warnings

MAX_SHOWN = 200  # characters of a user's value an error line quotes
MAX_LINE = 2000  # an error line longer than this (a value quoted whole by mistake) keeps its start and end


def shown(value, limit: int = MAX_SHOWN) -> str:
  """`repr(value)`, cut to about `limit` characters: `'xxxx…' (100002 characters)` for a long string."""
  text = repr(value)
  if len(text) <= limit:
    return text
  size = f"{len(value)} characters" if isinstance(value, (str, bytes)) else f"{len(text)} characters as text"
  return f"{text[:limit]}… ({size})"


def first_line(e: BaseException) -> str:
  """The first line of an exception's message (its type's name when it has none), cut to 300 characters: what an
  error line quotes of a dependency's error."""
  lines = str(e).strip().splitlines()
  return (lines[0] if lines else type(e).__name__)[:300]


def _capped(message: str) -> str:
  if len(message) <= MAX_LINE:
    return message
  half = MAX_LINE // 2
  return f"{message[:half]} …[{len(message) - MAX_LINE} characters left out]… {message[-half:]}"


class InspectError(Exception):
  """Base class of every error the library raises on purpose; a message over `MAX_LINE` characters is cut in
  the middle (an error is one line, naming the value and what is accepted)."""

  exit_code = 2

  def __init__(self, *args):
    if len(args) == 1 and isinstance(args[0], str):
      args = (_capped(args[0]),)
    super().__init__(*args)


class InputError(InspectError):
  """Bad user input: a key, a value, a path, a file's contents."""


class ConfigError(InputError):
  """A configuration key or value is not acceptable."""


class UnknownKeyError(ConfigError):
  """A key that the configuration does not know, with the closest known keys suggested."""

  def __init__(self, key: str, known: list[str] | tuple[str, ...], what: str = "config key"):
    close = difflib.get_close_matches(key, known, n=3, cutoff=0.6)
    hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    super().__init__(f"unknown {what} {shown(key)}{hint}")
    self.key = key
    self.suggestions = close


class CheckpointError(InputError):
  """A checkpoint path is missing, unreadable or not what was expected."""


class MismatchError(InputError):
  """Weights in a checkpoint do not fit the model: names the missing and mis-shaped weights."""


class Interrupted(BaseException):
  """SIGTERM, SIGHUP, SIGINT or SIGQUIT arrived: raised in the main thread so that partial outputs are removed."""

  def __init__(self, signum: int):
    super().__init__(signal.Signals(signum).name)
    self.signum = signum
    self.exit_code = 128 + signum


def quiet_closed_event_loop() -> None:
  """Drops the asyncio teardown tracebacks that follow a failed Orbax restore (after its one-line error).

  When a restore fails, Orbax's asyncio loop closes while tensorstore reads it started are still in flight:
  each read that completes afterwards calls `loop.call_soon_threadsafe` from a tensorstore thread, which raises
  `RuntimeError('Event loop is closed')` and is printed through `sys.excepthook`; and the read coroutines left
  unfinished raise again when they are garbage-collected ("Exception ignored in: <coroutine ...>", through
  `sys.unraisablehook`, or as a "coroutine ... was never awaited" warning); the futures gathering them log
  "exception was never retrieved" (asyncio's logger).
  Thousands of tracebacks would follow the error line. Those kinds are dropped; every other exception still
  reaches the previous hooks.
  """
  def closed_loop(value) -> bool:
    return isinstance(value, RuntimeError) and str(value) == "Event loop is closed"

  previous, previous_unraisable = sys.excepthook, sys.unraisablehook
  if getattr(previous, "quiet_closed_event_loop", False):
    return

  def hook(kind, value, traceback):
    if not closed_loop(value):
      previous(kind, value, traceback)

  def unraisable_hook(unraisable):
    if not (closed_loop(unraisable.exc_value) or inspect.iscoroutine(unraisable.object)):
      previous_unraisable(unraisable)

  hook.quiet_closed_event_loop = True
  sys.excepthook, sys.unraisablehook = hook, unraisable_hook
  logging.getLogger("asyncio").addFilter(lambda record: "exception was never retrieved" not in record.getMessage())
  warnings.filterwarnings("ignore", message="coroutine .* was never awaited", category=RuntimeWarning)
