"""Safe writes to a gs:// destination, where no rename is atomic: stage, validate, publish, commit marker last.

`claim(dst, ...)` (through `destination.claim`) refuses a DST that is the bucket, is, contains or lies inside a gs://
source, an existing DST without `--overwrite`, and with it anything but an earlier export or an Orbax checkpoint;
it takes DST's lock object (`remote_lock`: create-only, heartbeat) and cleans up after earlier runs that died.
`staged_directory(dst)` (through `atomic.atomic_directory`) then gives the run its staging prefix:
1. every process writes its share of the export directly under the sibling staging prefix
   `.<name>.inspect-tmp-<run id>/` (Orbax's layout: its own OCDBT database through tensorstore's `gcs` kvstore;
   safetensors: streamed uploads, `streaming.object_shards`), and process 0 completes it there (the merge, the
   metadata, the validation reading it back, the reports): nothing is written to local disk;
2. `STAGED` is written last into the staging prefix;
3. publish: the lock records "publishing"; DST's commit marker goes first, then the objects that are not in the
   new export; the staged objects are copied in (server-side), Orbax's own marker `<step>/commit_success.txt`
   is written into each step and item, and `DST/commit_success.txt` last; the staging prefix and the lock are removed.
A reader that lists DST sees nothing or the previous export until step 3; during step 3, objects without
`DST/commit_success.txt` and with the lock beside DST, which readers refuse as incomplete (`storage.commit`). A run
killed before step 3 leaves only its staging prefix and its lock, which the next run on DST removes; one killed in
step 3 leaves the lock saying "publishing" and the complete staging prefix, and the next run completes the
publication.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
from typing import Iterator, Sequence

from inspect_tool import errors
from inspect_tool.output import hooks
from inspect_tool.output import ours
from inspect_tool.output import remote_lock
from inspect_tool.output import stop
from inspect_tool.storage import commit
from inspect_tool.storage import objects
from inspect_tool.storage import paths

MARKER = commit.MARKER
STAGED = ".inspect_checkpoint-staged"  # the last object of a complete staging prefix
REPORTS = (("quantization_report.json", "producer"), ("import_report.json", "producer"),
           ("model.safetensors.index.json", "metadata"))
_ORBAX_FILES = ("_CHECKPOINT_METADATA", "_METADATA", "manifest.ocdbt", MARKER)
_ORBAX_DIRS = ("/_CHECKPOINT_METADATA", "/_METADATA")  # a step, an item: Orbax wants its marker in each
_held: dict[str, tuple[remote_lock.Lock, bool]] = {}  # DST -> (its lock, overwrite) while claimed


def staging_prefix(dst: str) -> str:
  """The names of DST's staging prefixes begin so (beside DST): `.<name>.inspect-tmp-`."""
  return f".{paths.basename(dst)}.inspect-tmp-"


def _failure(dst: str, e: BaseException) -> errors.InputError:
  reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
  reason = re.split(r" \[(?:http_response|source locations)", reason)[0][:300]  # tensorstore's details
  return errors.InputError(f"cannot write {dst!r}: {reason}")


def check_clear_of_inputs(dst: str, sources: Sequence[str | None] = ()) -> str:
  """DST normalized; refuses the bucket itself and a DST that is, contains or lies inside a gs:// source."""
  path = paths.normalize(dst)
  if not paths.split(path)[1]:
    raise errors.InputError(f"output {dst!r} is a whole bucket; give a prefix inside it, e.g. {path}/fp8-export")
  for source in sources:
    if not source or not paths.is_remote(source):
      continue
    src = paths.normalize(source)
    if path == src:
      raise errors.InputError(f"output {dst!r} is the source {source!r}; choose another path")
    if src.startswith(path + "/"):
      raise errors.InputError(f"output {dst!r} contains the source {source!r}; choose a path that does not")
    if path.startswith(src + "/"):
      raise errors.InputError(f"output {dst!r} lies inside the source {source!r}; choose a path outside it")
  return path


def replaceable(dst: str, names: Sequence[str]) -> str | None:
  """What makes the objects `names` under DST replaceable ('inspect_checkpoint export', 'Orbax checkpoint')."""
  present = set(names)
  for name, field in REPORTS:
    if name in present:
      data, _ = objects.read(paths.join(dst, name))
      try:
        if data is not None and len(data) < 16 << 20 and ours.names_producer(json.loads(data), field):
          return "inspect_checkpoint export"
      except (ValueError, RecursionError):
        pass
  for name in present:
    directory, _, leaf = name.rpartition("/")
    if leaf in _ORBAX_FILES and (directory in ("", "items") or directory.split("/")[0].isdigit()):
      return "Orbax checkpoint"
  return None


def check_replace(dst: str, overwrite: bool) -> list[str]:
  """The names under DST; refuses an existing DST without `overwrite`, and any that is not a checkpoint."""
  names = objects.names(dst)
  single = objects.read(dst)[0] is not None
  if not names and not single:
    return names
  if not overwrite:
    raise errors.InputError(f"output {dst!r} already exists; pass --overwrite to replace it")
  if not names:
    raise errors.InputError(f"output {dst!r} is an object (a file); --overwrite replaces only a checkpoint "
                            "directory (an earlier export or an Orbax checkpoint)")
  if replaceable(dst, names) is None:
    raise errors.InputError(f"output {dst!r} is a prefix that is not a checkpoint; --overwrite replaces only an "
                            "earlier export or an Orbax checkpoint, so remove it yourself or choose another path")
  return names


@contextlib.contextmanager
def claim(dst: str, *, sources: Sequence[str | None] = (), overwrite: bool = False) -> Iterator[ours.Claim]:
  """`destination.claim` for a gs:// DST: checked, locked and cleaned up after dead runs (module docstring)."""
  path = check_clear_of_inputs(dst, sources)
  try:  # locked first: a run killed while publishing is completed (`reclaim`) before DST is judged
    lock = remote_lock.acquire(path, f"{os.getpid()}-{secrets.token_hex(4)}")
  except (OSError, ValueError, RuntimeError) as e:
    raise _failure(path, e) from None
  try:
    try:
      reclaimed = reclaim(path, lock)
      check_replace(path, overwrite)
    except (OSError, ValueError, RuntimeError) as e:
      raise _failure(path, e) from None
    _held[path] = (lock, overwrite)
    yield ours.Claim(path=path, overwrite=overwrite, reclaimed=reclaimed)
  finally:
    _held.pop(path, None)
    lock.release()


def reclaim(dst: str, lock: remote_lock.Lock) -> list[str]:
  """Cleans up after dead runs on DST (we hold its lock: every other staging prefix is a dead run's): completes
  the publication of a run that died publishing and removes the other staging prefixes. Returns what was completed
  or removed."""
  parent, start, done = paths.parent(dst), staging_prefix(dst), []
  staged: dict[str, list[str]] = {}
  for name in objects.names_from(parent, start):
    head, _, rest = name.partition("/")
    staged.setdefault(head, []).append(rest)
  previous = lock.previous or {}
  for head, names in sorted(staged.items()):
    prefix = paths.join(parent, head)
    if previous.get("state") == "publishing" and head == start + str(previous.get("staging")) and STAGED in names:
      lock.set_state("publishing", staging=previous["staging"])  # a kill now leaves the same task to the next run
      publish(prefix, dst, [n for n in names if n != STAGED])
      lock.set_state("writing", staging=None)
      done.append(f"{dst} (published from {prefix})")
    objects.delete_all(prefix, names)
    done.append(prefix)
  return done


class WrittenMeanwhile(errors.InputError):
  """Someone else wrote under DST while we published: ours are removed again, theirs left as they are."""


def publish(staging: str, dst: str, names: Sequence[str]) -> None:
  """Replaces DST by the staged objects `names` (module docstring, step 3); safe to run again after a kill.

  Raises:
    WrittenMeanwhile: objects that are not ours appeared under DST while ours were copied (another writer): the
      commit markers are not written and ours are deleted again.
  """
  old = objects.names(dst)
  if MARKER in old:
    objects.delete(paths.join(dst, MARKER))  # first: from now on readers see DST as incomplete
  new = set(names)
  objects.delete_all(dst, [n for n in old if n != MARKER and n not in new])
  names = sorted(names)
  half = len(names) // 2
  objects.copy(staging, dst, names[:half])
  hooks.test_point("publishing")
  objects.copy(staging, dst, names[half:])
  foreign = sorted(set(objects.names(dst)) - set(names))
  if foreign:
    objects.delete_all(dst, names)
    raise WrittenMeanwhile(f"output {dst!r} was written by someone else while this run published it ({len(foreign)} "
                           f"object(s) not ours, e.g. {errors.shown(foreign[0])}); theirs are left as they are and "
                           "ours removed; accepted: another --output, or run again once theirs is gone")
  for directory in sorted({n.rpartition("/")[0] for n in names if n.endswith(_ORBAX_DIRS)} - {""}):
    url = paths.join(dst, directory)  # Orbax's own marker in each step and item: Orbax reads them as finalized
    objects.write(paths.join(url, MARKER), f"Checkpoint commit was successful to {url}".encode())
  objects.write(paths.join(dst, MARKER), f"inspect_checkpoint: commit was successful to {dst}\n".encode())


@contextlib.contextmanager
def staged_directory(dst: str, *, overwrite: bool = False) -> Iterator[str]:
  """`atomic.atomic_directory` for a gs:// DST claimed by `claim`: yields the staging prefix, where every process
  writes its share directly; on success its objects replace DST (`STAGED` written there, then `publish`)."""
  dst = paths.normalize(dst)
  if dst not in _held:
    raise AssertionError(f"{dst} is written without being claimed (destination.claim)")
  lock, _ = _held[dst]
  staging = paths.join(paths.parent(dst), staging_prefix(dst) + lock.content["id"])
  cleanup = stop.add_cleanup(  # if a stop cannot wait for us; once publishing, the next run completes it
      lambda: None if lock.content.get("state") == "publishing" else _abandon(staging, None))
  try:
    try:
      yield staging
    except BaseException:  # the run's own failure, reported as it is
      _abandon(staging, None)
      raise
    _publish_staged(staging, dst, lock, overwrite)
  finally:
    stop.remove_cleanup(cleanup)


def _publish_staged(staging: str, dst: str, lock: remote_lock.Lock, overwrite: bool) -> None:
  """Steps 2 and 3 of the module docstring for the complete staging prefix."""
  publishing = False
  try:
    stop.check()
    hooks.test_point("upload")
    names = [n for n in objects.names(staging) if n != STAGED]
    objects.write(paths.join(staging, STAGED), f"{dst}\n".encode())
    hooks.test_point("staged")
    stop.check()
    check_replace(dst, overwrite)  # it may have appeared (or changed) while we worked
    lock.set_state("publishing", staging=lock.content["id"])
    publishing = True
    publish(staging, dst, names)
    hooks.test_point("published")
    objects.delete_all(staging)
  except WrittenMeanwhile:
    _abandon(staging, None)  # nothing of ours is left under DST to complete
    raise
  except (OSError, ValueError, RuntimeError) as e:
    _abandon(staging, lock if publishing else None)
    raise _failure(dst, e) from None
  except BaseException:
    _abandon(staging, lock if publishing else None)
    raise


def _abandon(staging: str, publishing: remote_lock.Lock | None) -> None:
  """After a failure: the staging prefix is removed, unless DST is half published (the next run completes it:
  the lock `publishing` is then left saying so)."""
  if publishing is not None:
    publishing.keep()
    return
  with contextlib.suppress(Exception):
    objects.delete_all(staging)
