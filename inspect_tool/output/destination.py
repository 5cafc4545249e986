"""Where an output may go: a destination never destroys an input, the working directory or foreign data.

`claim(dst, sources=..., overwrite=...)` is held for a whole run that writes the directory `dst`:
- it refuses `''`, a DST that is, contains or lies inside a source, its steps directory or the working
  directory, a symbolic link, and (with `--overwrite`) anything but a checkpoint directory this tool or Orbax
  wrote (`replaceable`);
- it takes an exclusive lock (`.<name>.lock` beside DST, `flock`), so a second run on the same DST fails with
  one line instead of silently replacing the first;
- it removes the temporary directories of earlier runs on this DST whose process is gone (a SIGKILL or power
  loss leaves one behind); only directories carrying this tool's marker are ever removed.

`check_apart(output, others)` is the rule every output of every command obeys: it is not, does not contain and does
not lie inside any input (or other output) of the command, with or without --overwrite (`cli.options` gathers them).
`check_output_file(path, overwrite)` is the rule for single-file outputs (`--output_file`, `--html`,
`--save-logits`): only a regular file is ever replaced (with `overwrite`); a directory, device, FIFO, socket or
symbolic link is refused. Sibling names (`.<name>.lock`, `.<name>.tmp-*`) are shortened with a hash so that
they fit the 255-byte name limit whenever the output's own name does (`sibling_stem`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import re
import stat
from typing import Iterator, Sequence

from inspect_tool import errors
from inspect_tool.output import object_store
from inspect_tool.output import ours
from inspect_tool.output import stop
from inspect_tool.output import trees
from inspect_tool.output.ours import PRODUCER, TMP_MARKER, Claim, names_producer  # noqa: F401  (re-exported)
from inspect_tool.storage import paths
_ORBAX_FILES = ("_CHECKPOINT_METADATA", "_METADATA", "manifest.ocdbt")


NAME_MAX = 255  # bytes in one path component (Linux file systems)
_SIBLING_RESERVE = 32  # what sibling names add to the stem: ".", ".tmp-<pid>-<8 random>.old", ".lock"


def absolute(path: str) -> str:
  """`os.path.abspath`, with a deleted working directory as one line (it cannot resolve a relative path)."""
  try:
    return os.path.abspath(path)
  except FileNotFoundError:
    raise errors.InputError(f"cannot resolve {path!r}: the working directory no longer exists; cd to an existing "
                            "directory or give an absolute path") from None


def _real(path: str) -> str:
  return os.path.realpath(absolute(path))


def sibling_stem(path: str) -> str:
  """The base name of `path` as its siblings (lock, temporaries) use it: shortened with a hash when too long."""
  name = os.path.basename(path)
  raw = os.fsencode(name)
  if len(raw) + _SIBLING_RESERVE <= NAME_MAX:
    return name
  digest = hashlib.sha256(raw).hexdigest()[:16]
  return f"{os.fsdecode(raw[:NAME_MAX - _SIBLING_RESERVE - len(digest) - 1])}~{digest}"


def _within(path: str, root: str) -> bool:
  """True when `path` is `root` or lies below it (both real paths)."""
  return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def temp_prefix(dst: str) -> str:
  """Prefix of the temporary directories of `dst` (beside it): `.<name>.tmp-<pid>-`."""
  return f".{sibling_stem(dst)}.tmp-{os.getpid()}-"


def lock_path(dst: str) -> str:
  """The lock file of `dst` (beside it): `.<name>.lock`."""
  return os.path.join(os.path.dirname(dst), f".{sibling_stem(dst)}.lock")


def _temp_pattern(dst: str) -> re.Pattern:
  return re.compile(rf"^\.{re.escape(sibling_stem(dst))}\.tmp-(\d+)-[A-Za-z0-9_]+(\.old)?$")


def protected_roots(sources: Sequence[str | None]) -> list[tuple[str, str, bool]]:
  """(real path, what, may an output lie inside it) of what an output must not be, contain or replace.

  An output may be neither, nor contain, a source or the working directory; it may lie inside the working
  directory but not inside a source. A source that is a numeric step (or its items directory) protects its
  steps directory too: a new directory there would become the run's "latest step".
  """
  roots = []
  for source in sources:
    if not source:
      continue
    real = _real(source)
    roots.append((real, f"the source {source!r}", False))
    for candidate in (real, os.path.dirname(real)):
      if os.path.basename(candidate).isdigit():
        roots.append((os.path.dirname(candidate), f"the steps directory of the source {source!r}", False))
        break
  with contextlib.suppress(OSError):
    roots.append((_real(os.getcwd()), "the working directory", True))
  return roots


def _check_roots(dst: str, real: str, roots: Sequence[tuple[str, str, bool]], what: str = "output") -> None:
  """Refuses `real` (the real path of `dst`) when it is, contains or (unless allowed) lies inside one of `roots`."""
  noun = "directory" if what == "output" else "path"
  for root, named, inside_ok in roots:
    if real == root:
      raise errors.InputError(f"{what} {dst!r} is {named}; choose another {noun}")
    if _within(root, real):
      raise errors.InputError(f"{what} {dst!r} contains {named}; choose a {noun} that does not")
    if _within(real, root) and not inside_ok:
      raise errors.InputError(f"{what} {dst!r} lies inside {named}; choose a {noun} outside it")


def check_clear_of_inputs(dst: str, sources: Sequence[str | None] = ()) -> str:
  """Returns DST's absolute path, or raises when writing it could touch an input or the working directory."""
  if not dst or not dst.strip():
    raise errors.InputError("output path is empty; give the directory to create, e.g. --output fp8-export")
  absolute_path = absolute(dst)
  _check_roots(dst, _real(dst), protected_roots(sources))
  return absolute_path


def check_apart(output: str, others: Sequence[tuple[str, str | None]], what: str = "output file") -> None:
  """The rule shared by every output of every command: `output` is not, does not contain and does not lie inside
  any of `others` ((its description, its path): the command's inputs and its other outputs), with or without
  --overwrite, so that no output replaces or writes into what the command reads or writes elsewhere. Paths by
  URL (gs://, http(s)://, hf://) are no place on this machine: they pass here (`object_store` keeps gs:// DSTs
  apart from gs:// sources)."""
  if not output or not output.strip() or paths.is_url(output):
    return
  roots = [(_real(path), named, False) for named, path in others if path and path.strip() and not paths.is_url(path)]
  _check_roots(output, _real(output), roots, what)


def replaceable(dst: str) -> str | None:
  """What makes the existing `dst` replaceable ('inspect_checkpoint export' or 'Orbax checkpoint'), else None."""
  if os.path.islink(dst) or not os.path.isdir(dst):
    return None
  report = os.path.join(dst, "quantization_report.json")
  index = os.path.join(dst, "model.safetensors.index.json")
  for path, field in ((report, "producer"), (index, "metadata")):
    if _json_producer(path, field):
      return "inspect_checkpoint export"
  candidates = [dst, os.path.join(dst, "items")]
  with contextlib.suppress(OSError):
    candidates += [os.path.join(dst, n) for n in os.listdir(dst) if n.isdigit()]
  for directory in candidates:
    if any(os.path.isfile(os.path.join(directory, name)) for name in _ORBAX_FILES):
      return "Orbax checkpoint"
  return None


def _json_producer(path: str, field: str) -> bool:
  """True when the small JSON file `path` names this tool as producer under `field`."""
  try:
    if not os.path.isfile(path) or os.path.getsize(path) > 16 << 20:
      return False
    with open(path, encoding="utf-8") as f:
      doc = json.load(f)
  except (OSError, ValueError, RecursionError):
    return False
  return names_producer(doc, field)




def check_replace(dst: str, overwrite: bool) -> None:
  """Refuses an existing `dst` without `overwrite`, and any existing `dst` that is not a checkpoint."""
  if not os.path.lexists(dst):
    return
  if not overwrite:
    raise errors.InputError(f"output {dst!r} already exists; pass --overwrite to replace it")
  if os.path.islink(dst):
    raise errors.InputError(f"output {dst!r} is a symbolic link; --overwrite replaces only a checkpoint "
                            "directory, give its real path")
  if not os.path.isdir(dst):
    raise errors.InputError(f"output {dst!r} is a file; --overwrite replaces only a checkpoint directory "
                            "(an earlier export or an Orbax checkpoint)")
  if replaceable(dst) is None:
    raise errors.InputError(f"output {dst!r} is a directory that is not a checkpoint; --overwrite replaces only "
                            "an earlier export or an Orbax checkpoint, so remove it yourself or choose another path")


_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symbolic link"))


def check_output_file(path: str, overwrite: bool) -> str:
  """The single-file rule; returns `path` made absolute.

  Only a regular file is ever replaced, and only with `overwrite`. A directory, device, FIFO or socket is
  refused, and so is a symbolic link (its target is named: give that path to replace it), so an output never
  turns one of them into a regular file or writes through a link to somewhere the user did not name.
  """
  if not path or not path.strip():
    raise errors.InputError("output file path is empty; give a file name")
  if os.fspath(path).startswith("gs://"):
    raise errors.InputError(f"output file {path!r} is on object storage; --output_file, --html and --save-logits "
                            "write local files only: give a local path (--output takes gs://)")
  absolute_path = absolute(path)
  try:
    mode = os.lstat(absolute_path).st_mode
  except FileNotFoundError:
    return absolute_path
  except OSError as e:
    raise errors.InputError(f"cannot write {path!r}: {e.strerror or e}") from None
  for test, kind in _KINDS:
    if test(mode):
      target = f" to {os.readlink(absolute_path)!r}" if stat.S_ISLNK(mode) else ""
      raise errors.InputError(f"output file {path!r} is {kind}{target}; give the name of a regular file "
                              "(an existing one is replaced only with --overwrite)")
  if not overwrite:
    raise errors.InputError(f"output file {path!r} already exists; pass --overwrite to replace it")
  return absolute_path




def _lock(path: str, dst: str) -> int:
  """Opens and exclusively locks `path` (created if missing); raises when another process holds it.

  Writing our pid into it is best effort: on a full file system the lock still works (an empty file), and a
  failure after creating the file removes it, so nothing is left behind.
  """
  while True:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
      os.close(fd)
      if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
        raise errors.InputError(f"output {dst!r} is being written by another "
                                "inspect_checkpoint run; wait for it to finish or choose another path") from None
      raise
    try:
      if os.fstat(fd).st_ino == os.stat(path).st_ino:  # still the file at `path` (not one a finisher unlinked)
        with contextlib.suppress(OSError):  # ENOSPC: the lock needs no content
          os.ftruncate(fd, 0)
          os.write(fd, f"{os.getpid()}\n".encode())
        return fd
    except FileNotFoundError:
      pass
    except BaseException:
      with contextlib.suppress(OSError):
        os.unlink(path)  # we hold its lock: no other run is using it
      os.close(fd)
      raise
    os.close(fd)


def reclaim_stale_temporaries(dst: str) -> list[str]:
  """Cleans up after earlier runs on `dst` that were killed: their process is gone, their directories remain.

  `.<name>.tmp-<pid>-*` directories are removed when they carry our marker (a partial output) or hold a
  checkpoint (a finished output, or the previous DST after the exchange). An aside copy `*.old` (the
  two-rename fallback was killed between its renames) is put back as DST when DST is missing. Returns what
  was removed or restored.
  """
  parent, pattern, done = os.path.dirname(dst), _temp_pattern(dst), []
  try:
    names = sorted(os.listdir(parent))
  except OSError:
    return done
  for name in names:
    match = pattern.match(name)
    path = os.path.join(parent, name)
    if not match or int(match.group(1)) == os.getpid() or ours.alive(int(match.group(1))):
      continue
    if os.path.islink(path) or not os.path.isdir(path):
      continue
    if match.group(2) and not os.path.lexists(dst) and replaceable(path):
      os.rename(path, dst)
      done.append(path)
      continue
    made_here = os.path.exists(os.path.join(path, TMP_MARKER)) or not os.listdir(path) or replaceable(path)
    if made_here:  # anything else is not a directory this tool made: never ours to delete
      trees.remove_tree(path)
      done.append(path)
  return done


@contextlib.contextmanager
def claim(dst: str, *, sources: Sequence[str | None] = (), overwrite: bool = False) -> Iterator[Claim]:
  """Checks `dst` against the inputs and the overwrite rule, locks it for the run and reclaims stale temporaries.

  Raises:
    errors.InputError: an empty path, a DST overlapping a source or the working directory, an existing DST
      without `overwrite` (or one that is not a checkpoint), a missing parent, or another run holding DST.
  """
  if paths.is_remote(dst):
    with object_store.claim(dst, sources=sources, overwrite=overwrite) as claimed:
      yield claimed
    return
  path = check_clear_of_inputs(dst, sources)
  parent = os.path.dirname(path)
  if not os.path.isdir(parent):
    raise errors.InputError(f"cannot write {path!r}: directory {parent!r} does not exist")
  check_replace(path, overwrite)
  lock = lock_path(path)
  try:
    fd = _lock(lock, path)
  except OSError as e:
    raise errors.InputError(f"cannot write {path!r}: cannot lock it ({e.strerror or e})") from None
  cleanup = stop.add_cleanup(lambda: _unlink(lock))  # if a stop cannot wait for us
  try:
    reclaimed = reclaim_stale_temporaries(path)
    check_replace(path, overwrite)  # again, now that no other run of ours can change it
    yield Claim(path=path, overwrite=overwrite, reclaimed=reclaimed)
  finally:
    stop.remove_cleanup(cleanup)
    _unlink(lock)  # while still locked: a waiting run re-checks the inode and creates a new file
    os.close(fd)


def _unlink(path: str) -> None:
  with contextlib.suppress(OSError):
    os.unlink(path)
