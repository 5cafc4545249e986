"""Resolves a user-given Orbax checkpoint path to the directory that holds one pytree's `_METADATA`.

Accepted forms: a step directory (`.../checkpoints/3`), its checkpointable directory (`.../3/items`) and a
directory of steps (`.../checkpoints`, the latest numeric step is taken). Anything else is a
`CheckpointError` whose one-line message names the path and what was expected.
"""

from __future__ import annotations

import dataclasses
import os

from inspect_tool import errors
from inspect_tool.checkpoint import files
from inspect_tool.storage import commit
from inspect_tool.storage import paths
from inspect_tool.storage import remote

TREE_METADATA = "_METADATA"
STEP_METADATA = "_CHECKPOINT_METADATA"
OCDBT_MANIFEST = "manifest.ocdbt"
DEFAULT_ITEM = "items"

_EXPECTED = ("expected an Orbax step directory (with items/_METADATA), its items directory, "
             "or a directory of numeric steps")


@dataclasses.dataclass(frozen=True)
class ResolvedPath:
  """Where the pytree lives: `items_dir` holds `_METADATA`; `step` is its step number if known."""

  items_dir: str
  step: int | None
  note: str = ""
  unpublished: bool | None = None  # this run's own gs:// output before its commit; None: ask `storage.commit.own`


def _is_tree_dir(path: str) -> bool:
  """Whether `path` holds `_METADATA`; one that is not a regular file, or unreadable, is refused here."""
  meta = paths.join(path, TREE_METADATA)
  found = files.kind(meta)
  if found == "other":
    raise errors.CheckpointError(f"{meta}: is not a regular file (FIFO, socket or device)")
  return found == "file"


def _looks_like_orbax(path: str) -> bool:
  return any(files.kind(paths.join(path, name)) != "missing" for name in (TREE_METADATA, STEP_METADATA,
                                                                              OCDBT_MANIFEST))


def _listdir(path: str) -> list[str]:
  if paths.is_remote(path):
    return remote.listdir(path)
  try:
    return sorted(os.listdir(path))
  except PermissionError:
    raise errors.CheckpointError(f"{path}: permission denied") from None
  except OSError:
    return []


def _step_of(path: str) -> int | None:
  name = paths.basename(path)
  return int(name) if name.isdigit() else None


def _numeric_steps(path: str) -> list[int]:
  names = _listdir(path)
  return sorted(int(n) for n in names if n.isdigit() and files.kind(paths.join(path, n)) == "dir")


def _checkpointable_dirs(step_dir: str) -> list[str]:
  names = _listdir(step_dir)
  dirs = [paths.join(step_dir, n) for n in names]
  return [n for n, d in zip(names, dirs) if files.kind(d) == "dir" and _is_tree_dir(d)]


def _resolve_step_dir(step_dir: str, note: str) -> ResolvedPath | None:
  """The pytree directory inside a step directory, or None if the step holds none."""
  step = _step_of(step_dir)
  if _is_tree_dir(paths.join(step_dir, DEFAULT_ITEM)):
    return ResolvedPath(paths.join(step_dir, DEFAULT_ITEM), step, note)
  names = _checkpointable_dirs(step_dir)
  if len(names) == 1:
    extra = f"using checkpointable {names[0]!r} (no 'items')"
    return ResolvedPath(paths.join(step_dir, names[0]), step, f"{note}; {extra}" if note else extra)
  if len(names) > 1:
    raise errors.CheckpointError(
        f"{step_dir}: several checkpointables ({', '.join(names)}) and none named 'items'; "
        f"pass the one to inspect, e.g. {paths.join(step_dir, names[0])}")
  return None


def _incomplete_message(path: str) -> str:
  items = paths.join(path, DEFAULT_ITEM)
  if files.kind(items) == "dir":
    path = items
    _listdir(path)
  if files.kind(paths.join(path, OCDBT_MANIFEST)) == "file" or files.kind(paths.join(path, "d")) == "dir":
    return (f"{path}: Orbax tree metadata {TREE_METADATA} is missing (array data is present); "
            "the checkpoint is incomplete or was written by an unsupported Orbax version")
  return f"{path}: Orbax step metadata found but no items/{TREE_METADATA}; the checkpoint is incomplete"


def resolve_orbax_path(path: str) -> ResolvedPath:
  """Finds the `items` directory for `path` (step dir, items dir, or directory of steps).

  Raises:
    errors.CheckpointError: the path is missing, not a directory, or not an Orbax checkpoint.
  """
  path = os.fspath(path)
  found = files.kind(path)
  if found == "missing":
    raise errors.CheckpointError(f"checkpoint path does not exist: {path}")
  if found != "dir":
    what = "a file" if found == "file" else "not a regular file"
    raise errors.CheckpointError(f"not an Orbax checkpoint ({what}, not a directory): {path}; {_EXPECTED}")
  path = paths.normalize(path)
  commit.check_published(path)  # gs://: a DST this tool is publishing is not read half written
  _listdir(path)  # an unreadable directory is "permission denied", not "incomplete"
  if _is_tree_dir(path):
    parent = paths.parent(path)
    return ResolvedPath(path, _step_of(parent) if _looks_like_orbax(parent) else None, "")
  resolved = _resolve_step_dir(path, "")
  if resolved is not None:
    return resolved
  if _looks_like_orbax(path):
    raise errors.CheckpointError(_incomplete_message(path))
  steps = [s for s in _numeric_steps(path)
           if _looks_like_orbax(paths.join(path, str(s))) or _checkpointable_dirs(paths.join(path, str(s)))]
  if steps:
    step = steps[-1]
    shown = ", ".join(str(s) for s in steps[-5:])
    more = f" (of {len(steps)}: ..., {shown})" if len(steps) > 5 else f" (of {shown})"
    note = f"using latest step {step}{more}" if len(steps) > 1 else f"using step {step}"
    resolved = _resolve_step_dir(paths.join(path, str(step)), note)
    if resolved is None:
      raise errors.CheckpointError(_incomplete_message(paths.join(path, str(step))))
    return resolved
  raise errors.CheckpointError(f"not an Orbax checkpoint: {path}; {_EXPECTED}")
