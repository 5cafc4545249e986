"""JAX's persistent compilation cache for `forward` and `export`: compiled programs are kept on disk, so a
second run with the same model, batch and devices loads them instead of compiling again.

Where: `$JAX_COMPILATION_CACHE_DIR` when set, else `$XDG_CACHE_HOME/inspect_checkpoint/jax` (default
`~/.cache/inspect_checkpoint/jax`). Off: `--no-compile-cache`, or `INSPECT_CHECKPOINT_COMPILE_CACHE=0`. A directory
that cannot be written turns the cache off with one warning line; the run goes on. In a multi-process job JAX
writes entries from process 0 only and every process reads them; an entry is written to a temporary file
and renamed into place (`quant.compat.atomic_compilation_cache_writes`), so a reader never sees half of one.
"""

from __future__ import annotations

import os
import sys
import tempfile

import jax

from inspect_tool import errors
from quant import compat

ENV = "INSPECT_CHECKPOINT_COMPILE_CACHE"
JAX_ENV = "JAX_COMPILATION_CACHE_DIR"
_ON, _OFF = ("1", "true", "on", "yes", ""), ("0", "false", "off", "no")
# Every program is kept: the small CPU programs too (JAX's default: those that took >= 1 s), of any size.
_THRESHOLDS = {"jax_persistent_cache_min_compile_time_secs": 0.0, "jax_persistent_cache_min_entry_size_bytes": -1}


def wanted() -> bool:
  """Whether `INSPECT_CHECKPOINT_COMPILE_CACHE` leaves the cache on (unset: on).

  Raises:
    errors.InputError: a value that is neither on nor off.
  """
  value = os.environ.get(ENV, "").strip().lower()
  if value not in _ON + _OFF:
    raise errors.InputError(f"{ENV}={os.environ[ENV]!r} is not on or off; accepted: 0, false, off, no (off) or "
                            "1, true, on, yes (on, the default)")
  return value not in _OFF


def directory() -> str:
  """The cache directory: `$JAX_COMPILATION_CACHE_DIR`, else the user's cache directory."""
  if os.environ.get(JAX_ENV):
    return os.environ[JAX_ENV]
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(base, "inspect_checkpoint", "jax")


def configure(enabled: bool = True) -> str | None:
  """Turns the cache on (before the first compile) unless `enabled` is False or the environment says off; returns
  the directory in use, or None when the cache is off."""
  if not (enabled and wanted()):
    jax.config.update("jax_enable_compilation_cache", False)  # also over a JAX_COMPILATION_CACHE_DIR of the user's
    return None
  path = directory()
  problem = _unwritable(path)
  if problem:
    sys.stderr.write(f"warning: compilation cache off: cannot write {path} ({problem}); runs compile every time "
                     f"(set {JAX_ENV} to a writable directory, or {ENV}=0)\n")
    jax.config.update("jax_enable_compilation_cache", False)
    return None
  try:
    compat.atomic_compilation_cache_writes()  # no truncated entry after a kill or a full disk
  except compat.CompatError:
    pass  # another JAX: its own writes
  jax.config.update("jax_enable_compilation_cache", True)
  jax.config.update("jax_compilation_cache_dir", path)
  for name, value in _THRESHOLDS.items():  # unless the user set them
    if name.upper() not in os.environ:
      jax.config.update(name, value)
  return path


def _unwritable(path: str) -> str | None:
  """Why `path` cannot hold cache entries (None: it can): created if missing, then a probe file written. A URL
  (gs://...) is left to JAX."""
  if "://" in path:
    return None
  try:
    os.makedirs(path, exist_ok=True)
    fd, probe = tempfile.mkstemp(prefix=".probe-", dir=path)
    os.close(fd)
    os.unlink(probe)
  except OSError as e:
    return e.strerror or type(e).__name__
  return None
