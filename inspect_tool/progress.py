"""Progress messages for long work: on stderr when it is a terminal, silent in pipes and files."""

from __future__ import annotations

import contextlib
import sys
import time


def enabled() -> bool:
  return sys.stderr.isatty()


@contextlib.contextmanager
def step(message: str):
  """Prints `message…` before the work and the elapsed time after it (terminal only)."""
  if not enabled():
    yield
    return
  start = time.perf_counter()
  sys.stderr.write(f"{message}…")
  sys.stderr.flush()
  try:
    yield
  finally:
    sys.stderr.write(f" {time.perf_counter() - start:.1f}s\n")
    sys.stderr.flush()
