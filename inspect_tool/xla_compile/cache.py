"""XLA's memory of a compiled program kept on disk, so that a second run of the same program reads it instead of
compiling again (minutes for a 671B step).

JAX's own persistent cache cannot serve a compile for a topology without its TPU (an executable compiled for
compile-only devices cannot be loaded back: "PjRtCompiler must be constructed with a Client"), and the executable is
not what a verdict needs: only its memory figures and Mosaic kernel count are kept. The key is the SHA-256 of the
lowered program (StableHLO, shardings included), the topology and slice count, and the JAX and libtpu versions: a
change to any of them compiles again. Entries live beside the compilation cache (`run.compile_cache.directory()`, under
`xla_memory/`) and follow its switch (`INSPECT_CHECKPOINT_COMPILE_CACHE=0`, `--no-compile-cache`); one that cannot be
written or read is skipped (the run compiles).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os

from inspect_tool import process_state
from inspect_tool.output import atomic
from inspect_tool.run import compile_cache

SUBDIRECTORY = "xla_memory"
_enabled = [True]
process_state.declare(f"{__name__}:_enabled", process_state.SETTING, lambda: not _enabled[0],
                      lambda: _enabled.__setitem__(0, True))


def set_enabled(enabled: bool) -> None:
  """`--no-compile-cache`: neither read nor write entries in this process."""
  _enabled[0] = enabled


def _directory() -> str | None:
  if not _enabled[0] or not compile_cache.wanted():
    return None
  return os.path.join(compile_cache.directory(), SUBDIRECTORY)


def key(program_text: str, topology: str, num_slices: int, libtpu_version: str) -> str:
  digest = hashlib.sha256()
  for part in (program_text, topology, str(num_slices), importlib.metadata.version("jax"), libtpu_version):
    digest.update(part.encode("utf-8"))
    digest.update(b"\0")
  return digest.hexdigest()


def load(entry: str) -> dict | None:
  """The kept record of `entry`, None when there is none (or the cache is off, or it cannot be read)."""
  directory = _directory()
  if directory is None:
    return None
  try:
    with open(os.path.join(directory, entry + ".json"), encoding="utf-8") as f:
      return json.load(f)
  except (OSError, ValueError):
    return None


def store(entry: str, record: dict) -> None:
  """Keeps `record` under `entry` (atomically); nothing when the cache is off or cannot be written."""
  directory = _directory()
  if directory is None:
    return
  try:
    os.makedirs(directory, exist_ok=True)
    atomic.atomic_write_text(os.path.join(directory, entry + ".json"), json.dumps(record))
  except OSError:
    pass
