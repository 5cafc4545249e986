"""Progress messages for long work on stderr: steps and bars on a terminal; otherwise, only for work that has run
`PLAIN_AFTER_SECONDS`, the named passes of `forward` and `export` as plain lines (`step(..., plain=True)`) and a
few lines of byte progress (`ByteProgress`), so that quick work in a pipe (and a refusal after it) prints nothing
but its result; nothing with `--quiet` (`set_quiet`)."""

from __future__ import annotations

import contextlib
import sys
import time

from inspect_tool import process_state


def enabled() -> bool:
  return not _QUIET and sys.stderr.isatty()


@contextlib.contextmanager
def step(message: str, *, plain: bool = False):
  """Prints `message…` before the work and the elapsed time after it on a terminal; with `plain`, off a terminal
  too when the work took `PLAIN_AFTER_SECONDS` or more: the line `message… 12.3s` once it is done (a failed step
  prints nothing: its error line speaks)."""
  if not enabled():
    start = time.perf_counter()
    yield
    elapsed = time.perf_counter() - start
    if plain and not _QUIET and elapsed >= PLAIN_AFTER_SECONDS:
      note(f"{message}… {elapsed:.1f}s")
    return
  start = time.perf_counter()
  sys.stderr.write(f"{message}…")
  sys.stderr.flush()
  try:
    yield
  finally:
    sys.stderr.write(f" {time.perf_counter() - start:.1f}s\n")
    sys.stderr.flush()


_QUIET = False


def set_quiet(quiet: bool) -> None:
  """`--quiet`: no progress output at all (steps and bars)."""
  global _QUIET  # pylint: disable=global-statement
  _QUIET = bool(quiet)


process_state.declare(f"{__name__}:_QUIET", process_state.SETTING, lambda: _QUIET, lambda: set_quiet(False))


PLAIN_AFTER_SECONDS = 10.0


class ByteProgress:
  """Progress of work measured in bytes and arrays: a tqdm bar on a terminal (arrays and bytes done, bytes/s,
  ETA); otherwise, once the work has taken `PLAIN_AFTER_SECONDS`, a plain line at each quarter and at the end;
  nothing with `--quiet`."""

  def __init__(self, description: str, total_bytes: int, total_arrays: int):
    self.description, self.total_bytes, self.total_arrays = description, max(int(total_bytes), 1), total_arrays
    self.done_bytes = self.done_arrays = 0
    self._start = time.perf_counter()
    self._bar = None
    self._next_quarter = 1
    self._plain_lines = 0
    if _QUIET:
      return
    if enabled():
      # lazy: tqdm, ~0.06 s to import: `maxtext`, `maxtext --devices` load this module without it
      import tqdm  # pylint: disable=import-outside-toplevel
      self._bar = tqdm.tqdm(total=self.total_bytes, desc=description, unit="B", unit_scale=True, unit_divisor=1024,
                            file=sys.stderr, dynamic_ncols=True, leave=True)
      self._bar.set_postfix_str(f"arrays 0/{total_arrays}")

  def update(self, nbytes: int, arrays: int = 0) -> None:
    self.done_bytes += int(nbytes)
    self.done_arrays += arrays
    if self._bar is not None:
      self._bar.update(int(nbytes))
      if arrays:
        self._bar.set_postfix_str(f"arrays {self.done_arrays}/{self.total_arrays}", refresh=False)
    elif not _QUIET:
      while self._next_quarter < 4 and self.done_bytes >= self.total_bytes * self._next_quarter / 4:
        elapsed = time.perf_counter() - self._start
        if elapsed < PLAIN_AFTER_SECONDS:  # short work stays silent in pipes and logs
          self._next_quarter += 1
          continue
        rate = self.done_bytes / elapsed if elapsed > 0 else 0.0
        eta = (self.total_bytes - self.done_bytes) / rate if rate else 0.0
        self._line(f"{self.description}: {self._next_quarter * 25}% ({self.done_arrays}/{self.total_arrays} arrays, "
                   f"{_size(self.done_bytes)}, {_size(rate)}/s, ETA {eta:.0f}s)")
        self._next_quarter += 1

  def close(self) -> None:
    if self._bar is not None:
      self._bar.close()
    elif not _QUIET and self._plain_lines:
      elapsed = time.perf_counter() - self._start
      self._line(f"{self.description}: done, {self.done_arrays} arrays, {_size(self.done_bytes)} in {elapsed:.1f}s")

  def __enter__(self):
    return self

  def __exit__(self, exc_type, *exc):
    if exc_type is None or self._bar is not None:
      self.close()  # a failed run says so in its error line, not with "done"

  def _line(self, text: str) -> None:
    self._plain_lines += 1
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


def _size(nbytes: float) -> str:
  for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
    if nbytes >= size:
      return f"{nbytes / size:.1f} {unit}"
  return f"{int(nbytes)} B"


def note(text: str) -> None:
  """One line on stderr that the user should see (unless `--quiet`), terminal or not."""
  if not _QUIET:
    sys.stderr.write(text + "\n")
    sys.stderr.flush()
