"""Safe writes to a gs:// destination, where no rename is atomic: written in place or staged, the commit marker last.

`claim(dst, ...)` (through `destination.claim`) refuses a DST that is the bucket, is, contains or lies inside a gs://
source, an existing DST without `--overwrite`, and with it anything but an earlier export or an Orbax checkpoint;
it takes DST's lock object (`remote_lock`: create-only, heartbeat) and cleans up after earlier runs that died.
`staged_directory(dst)` (through `atomic.atomic_directory`) then gives the run the prefix every process writes its
share of the export to directly (Orbax's layout: its own OCDBT database through tensorstore's `gcs` kvstore;
safetensors: streamed uploads, `streaming.object_shards`), where process 0 completes it (the merge, the metadata,
the validation reading it back, the reports); nothing is written to local disk. That prefix is

* DST itself when DST does not exist (as Orbax writes a step on Cloud Storage): the lock records "in-place" first;
  once the run's work is done, DST is listed and any object not of our layouts (`is_ours`) means someone else wrote
  there meanwhile (ours are removed, theirs left); then Orbax's marker `<step>/commit_success.txt` goes into each
  step and item (until then Orbax's checkpointer reads none of it; our validation reads it through Orbax's handler,
  `storage.commit.own`) and `DST/commit_success.txt` is written last. Nothing is copied.
* a sibling staging prefix `.<name>.inspect-tmp-<run id>/` when DST exists (`--overwrite` of an earlier export),
  which stays whole until the new export is: `STAGED` is written last into it, then it is published: the lock
  records "publishing"; DST's commit marker goes first, then the objects that are not in the new export; the
  staged objects are copied in (server-side), Orbax's markers are written, and `DST/commit_success.txt` last; the
  staging prefix is removed.
A reader that lists DST sees nothing or the previous export, or objects without `DST/commit_success.txt` with the
lock beside DST, which readers refuse as incomplete (`storage.commit`), until the marker is written. A run killed
before it leaves its lock, and either its objects in DST ("in-place"), which the next run on DST removes, or its
staging prefix; one killed while publishing leaves the lock saying "publishing" and the complete staging prefix,
and the next run completes the publication.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
from typing import Iterator, Sequence

from inspect_tool import process_state
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
# The names our exports and imports write (written in place, DST holds nothing else): Orbax's layout (a step, its
# items, the processes' OCDBT databases), safetensors shards and their temporaries, the reports, the marker.
_OURS = re.compile(r"""(?x)
  \d+/(?:_CHECKPOINT_METADATA|commit_success\.txt)
  | \d+/items/(?:_METADATA|_sharding|_CHECKPOINT_METADATA|manifest\.ocdbt|commit_success\.txt|d/[^/]+
                 |ocdbt\.process_\d+/(?:manifest\.ocdbt|d/[^/]+))
  | [^/]+\.safetensors(?:\.compose-\d+-\d+)?
  | \.shard-\d+\.safetensors\.tmp(?:\.header|\.part-\d+|\.compose-\d+-\d+)?
  | (?:quantization_report|import_report|export_manifest|model\.safetensors\.index|config)\.json
  | commit_success\.txt""")
_held: dict[str, tuple[remote_lock.Lock, bool]] = {}  # DST -> (its lock, overwrite) while claimed
process_state.declare(f"{__name__}:_held", process_state.RUN, lambda: sorted(_held))


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
  place = paths.place(dst)  # resolved once: the checks, the lock and the writers read it
  lock_url = commit.lock_url(place.path)
  path = check_clear_of_inputs(place.path, sources)
  try:  # locked first: a run killed while publishing is completed (`reclaim`) before DST is judged
    lock = remote_lock.acquire(path, f"{os.getpid()}-{secrets.token_hex(4)}", url=lock_url)
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


def is_ours(name: str) -> bool:
  """Whether the object `name` (relative to DST) is one our exports and imports write."""
  return _OURS.fullmatch(name) is not None


def reclaim(dst: str, lock: remote_lock.Lock) -> list[str]:
  """Cleans up after dead runs on DST (we hold its lock: every other staging prefix is a dead run's): removes the
  objects of a run that died writing DST in place, completes the publication of a run that died publishing and
  removes the other staging prefixes. Returns what was removed or completed."""
  parent, start, done = paths.parent(dst), staging_prefix(dst), []
  previous = lock.previous or {}
  if previous.get("state") == "in-place" and not objects.exists(paths.join(dst, MARKER)):
    left = [n for n in objects.names(dst) if is_ours(n)]
    objects.delete_all(dst, left)
    done.append(f"{dst} ({len(left)} object(s) of a run that died writing it)")
  staged: dict[str, list[str]] = {}
  for name in objects.names_from(parent, start):
    head, _, rest = name.partition("/")
    staged.setdefault(head, []).append(rest)
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
  _commit(dst, names)


def _commit(dst: str, names: Sequence[str]) -> None:
  """Orbax's own marker into each step and item of DST (Orbax reads them as finalized), DST's marker last."""
  for directory in sorted({n.rpartition("/")[0] for n in names if n.endswith(_ORBAX_DIRS)} - {""}):
    url = paths.join(dst, directory)
    objects.write(paths.join(url, MARKER), f"Checkpoint commit was successful to {url}".encode())
  objects.write(paths.join(dst, MARKER), f"inspect_checkpoint: commit was successful to {dst}\n".encode())


@contextlib.contextmanager
def staged_directory(dst: str, *, overwrite: bool = False) -> Iterator[str]:
  """`atomic.atomic_directory` for a gs:// DST claimed by `claim`: yields the prefix where every process writes its
  share directly, DST itself when DST does not exist, else a staging prefix whose objects replace DST on success
  (`STAGED` written there, then `publish`) (module docstring)."""
  dst = paths.normalize(dst)
  if dst not in _held:
    raise AssertionError(f"{dst} is written without being claimed (destination.claim)")
  lock, _ = _held[dst]
  if not objects.names(dst):
    with _in_place(dst, lock):
      yield dst
    return
  staging = paths.join(paths.parent(dst), staging_prefix(dst) + lock.content["id"])
  cleanup = stop.add_cleanup(  # if a stop cannot wait for us; once publishing, the next run completes it
      lambda: None if lock.content.get("state") == "publishing" else _abandon(staging, None))
  try:
    try:
      with commit.writing(staging):
        yield staging
    except BaseException:  # the run's own failure, reported as it is
      _abandon(staging, None)
      raise
    _publish_staged(staging, dst, lock, overwrite)
  finally:
    stop.remove_cleanup(cleanup)


@contextlib.contextmanager
def _in_place(dst: str, lock: remote_lock.Lock) -> Iterator[None]:
  """DST written in place (it did not exist): on success checked for objects not ours and committed; on any
  failure (or a stop that cannot wait) our objects are removed from it."""
  try:
    lock.set_state("in-place")  # from now on a run that dies leaves its objects in DST to the next run to remove
  except (OSError, ValueError, RuntimeError) as e:
    raise _failure(dst, e) from None
  committed = []
  cleanup = stop.add_cleanup(lambda: None if committed else _remove_ours(dst))
  try:
    with commit.writing(dst):
      try:
        yield
        stop.check()
        hooks.test_point("upload")
        hooks.test_point("staged")
        _only_ours(dst)  # checked once the work is done, and again just before the marker
        stop.check()
        hooks.test_point("publishing")
        _commit(dst, _only_ours(dst))
        committed.append(True)
        hooks.test_point("published")
      except WrittenMeanwhile:
        raise
      except (OSError, ValueError, RuntimeError) as e:
        _remove_ours(dst)
        raise _failure(dst, e) from None
      except BaseException:
        _remove_ours(dst)
        raise
  finally:
    stop.remove_cleanup(cleanup)


def _only_ours(dst: str) -> list[str]:
  """The names under DST, written in place, when all are ours; else ours are removed and `WrittenMeanwhile`."""
  names = objects.names(dst)
  foreign = [n for n in names if not is_ours(n)]
  if foreign:
    objects.delete_all(dst, [n for n in names if is_ours(n)])
    raise WrittenMeanwhile(f"output {dst!r} was written by someone else while this run wrote it ({len(foreign)} "
                           f"object(s) not ours, e.g. {errors.shown(foreign[0])}); theirs are left as they are and "
                           "ours removed; accepted: another --output, or run again once theirs is gone")
  return names


def _remove_ours(dst: str) -> None:
  """After a failure of a run writing DST in place: its objects removed, anyone else's left."""
  with contextlib.suppress(Exception):
    objects.delete_all(dst, [n for n in objects.names(dst) if is_ours(n)])


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
