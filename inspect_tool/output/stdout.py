"""Standard output as an output like any other: a write that fails (a full disk, a closed pipe) is one line.

`echo(text)` prints a report; `flush()` ends a run (the last buffered bytes can fail too). After a failure
stdout is pointed at /dev/null, so Python's own flush at exit has nothing left to complain about.
"""

from __future__ import annotations

import errno
import os
import sys

import click

from inspect_tool import errors

_REASONS = {errno.ENOSPC: "no space left on device", errno.EPIPE: "the reader closed the pipe",
            errno.EDQUOT: "disk quota exceeded", errno.EFBIG: "file too large", errno.EIO: "input/output error"}


def is_write_failure(e: OSError) -> bool:
  """Whether `e` is what a failed write to a stream raises (no file name: not an open, read or rename)."""
  return e.filename is None and (isinstance(e, BrokenPipeError) or e.errno in _REASONS)


def failure(e: OSError) -> errors.InputError:
  """The one line for a failed write to stdout (stdout is silenced so that the exit flush cannot fail again)."""
  silence()
  reason = _REASONS.get(e.errno, e.strerror or type(e).__name__)
  return errors.InputError(f"cannot write to standard output: {reason}")


def silence() -> None:
  """Points file descriptor 1 at /dev/null (anything still buffered is dropped, not raised at exit)."""
  try:
    fd = sys.stdout.fileno()
    devnull = os.open(os.devnull, os.O_WRONLY)
  except (OSError, ValueError, AttributeError):
    return
  try:
    os.dup2(devnull, fd)
  except OSError:
    pass
  finally:
    os.close(devnull)


def echo(text: str) -> None:
  """Prints `text` as is (no newline added); a failed write raises the one line."""
  try:
    click.echo(text, nl=False)
  except OSError as e:
    raise failure(e) from None


def flush() -> None:
  """Flushes stdout; a failure raises the one line."""
  try:
    if sys.stdout is not None:
      sys.stdout.flush()
  except OSError as e:
    raise failure(e) from None
  except ValueError:  # closed
    pass
