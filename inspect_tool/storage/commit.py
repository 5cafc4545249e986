"""Whether a gs:// checkpoint this tool publishes is complete: its commit marker, written last.

On object stores an export is written in place (a new DST) or published object by object (`output.object_store`):
`DST/commit_success.txt` is written last (and, replacing an export, deleted first), and `.<name>.inspect-lock` beside
DST exists meanwhile. A reader given DST, its
step or its items prefix refuses it in one line while a lock is there and the marker is not (`check_published`);
checkpoints without such a lock (written by Orbax, uploaded) are read as they are.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from inspect_tool import process_state
from inspect_tool import errors
from inspect_tool.storage import objects
from inspect_tool.storage import paths

MARKER = "commit_success.txt"  # Orbax's commit marker name on object stores; DST's, written last
_own: set[str] = set()  # the DSTs this process writes in place: it reads them back (validation) before the marker
process_state.declare(f"{__name__}:_own", process_state.RUN, lambda: sorted(_own))


@contextlib.contextmanager
def writing(dst: str) -> Iterator[None]:
  """While this process writes the gs:// prefix `dst` (a DST in place, or a staging prefix) its own reads of it are
  not refused as incomplete (`check_published`, `own`)."""
  dst = paths.normalize(dst)
  _own.add(dst)
  try:
    yield
  finally:
    _own.discard(dst)


def lock_url(dst: str) -> str:
  """The lock object of the gs:// destination `dst` (beside it)."""
  return paths.join(paths.parent(dst), f".{paths.basename(dst)}.inspect-lock")


def _exists(url: str) -> bool:
  return objects.exists(url)


def _candidates(path: str) -> list[str]:
  """`path` and the two prefixes above it (DST/0/items -> DST/0 -> DST), within the bucket."""
  out = [paths.normalize(path)]
  for _ in range(2):
    up = paths.parent(out[-1])
    if not paths.split(up)[1]:
      break
    out.append(up)
  return out


def own(path: str) -> bool:
  """Whether `path` (DST, its step or its items prefix) lies in a prefix this process is writing (`writing`)."""
  return bool(_own) and any(c in _own for c in _candidates(path))


def committed(path: str) -> bool:
  """Whether `path` (DST, its step or its items prefix) lies in a DST carrying the commit marker."""
  return any(_exists(paths.join(c, MARKER)) for c in _candidates(path))


def check_published(path: str) -> None:
  """Raises when `path` lies in a DST being published (or left half published by a killed run).

  Raises:
    errors.CheckpointError: a lock beside DST and no commit marker in it.
  """
  if not paths.is_remote(path):
    return
  if own(path):
    return
  for candidate in _candidates(path):
    if _exists(lock_url(candidate)) and not _exists(paths.join(candidate, MARKER)):
      if any(_exists(paths.join(c, MARKER)) for c in _candidates(candidate)[1:]):
        return
      raise errors.CheckpointError(f"{candidate}: incomplete: an inspect_checkpoint export is writing or "
                                   f"publishing it (no {MARKER} yet); read it once that run ends (a killed run's "
                                   "objects are removed, or its publication completed, by the next export to the "
                                   "same --output)")
