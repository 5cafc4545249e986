"""Atomic output: files and directories appear complete or not at all (temporary path, then rename)."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import tempfile
from typing import Iterator

from inspect_tool import errors
from inspect_tool.output import destination
from inspect_tool.output import object_store
from inspect_tool.output import stop
from inspect_tool.output import trees
from inspect_tool.output.hooks import KILL_ENV, PAUSE_ENV, test_point  # noqa: F401  (re-exported)
from inspect_tool.storage import objects
from inspect_tool.storage import paths


def _os_error_message(path: str, e: OSError) -> str:
  reason = {errno.ENOSPC: "no space left on device", errno.EACCES: "permission denied",
            errno.EROFS: "read-only file system", errno.ENOENT: "directory does not exist"}.get(
                e.errno, e.strerror or type(e).__name__)
  return f"cannot write {path!r}: {reason}"


def _umask() -> int:
  mask = os.umask(0)
  os.umask(mask)
  return mask


def check_umask(dst: str) -> None:
  """Refuses, in one line, a umask that takes the owner's read, write or search permission from what a run
  writes (0777, 0200, ...): the output could not be written, nor read back."""
  mask = _umask()
  if mask & 0o700:
    raise errors.InputError(f"umask {mask:04o} takes the owner's permissions from what this run writes, so {dst!r} "
                            "could not be written or read back; accepted: a umask that leaves the owner rwx, e.g. "
                            "0022 or 0077")


def new_file_mode() -> int:
  """The permissions `open()` gives a new file: 0o666 less the umask."""
  return 0o666 & ~_umask()


def atomic_write_bytes(path: str, data: bytes, *, overwrite: bool = True) -> None:
  """Writes `data` to `path` through a temporary file in the same directory and a rename.

  The single-file rule (`destination.check_output_file`), checked before writing and again just before the
  rename: only a regular file is replaced, and only with `overwrite` (without it the rename never replaces a
  file that appeared meanwhile); a directory, device, FIFO, socket or symbolic link is refused.
  """
  target = destination.check_output_file(path, overwrite)
  try:
    fd, tmp = tempfile.mkstemp(prefix=f".{destination.sibling_stem(target)}.", suffix=".tmp",
                               dir=os.path.dirname(target))
  except OSError as e:
    raise errors.InputError(_os_error_message(path, e)) from None
  try:
    os.chmod(tmp, new_file_mode())  # mkstemp creates 0600; give the file the permissions open() would
    with os.fdopen(fd, "wb") as f:
      f.write(data)
      f.flush()
      os.fsync(f.fileno())
    destination.check_output_file(path, overwrite)  # again: it may have appeared or changed while we wrote
    if overwrite:
      os.replace(tmp, target)
    else:
      _file_no_replace(tmp, target)
  except FileExistsError:
    with contextlib.suppress(OSError):
      os.unlink(tmp)
    raise errors.InputError(f"output file {path!r} already exists; pass --overwrite to replace it") from None
  except OSError as e:
    with contextlib.suppress(OSError):
      os.unlink(tmp)
    raise errors.InputError(_os_error_message(path, e)) from None
  except BaseException:
    with contextlib.suppress(OSError):
      os.unlink(tmp)
    raise


def _file_no_replace(tmp: str, target: str) -> None:
  """Moves the file `tmp` to `target` unless `target` exists (then FileExistsError): renameat2 or link+unlink."""
  if _renameat2(tmp, target, _RENAME_NOREPLACE):
    return
  try:
    os.link(tmp, target)
  except FileExistsError:
    raise
  except OSError:  # a file system without hard links: check, then rename (a narrow window)
    if os.path.lexists(target):
      raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), target) from None
    os.rename(tmp, target)
    return
  os.unlink(tmp)


def atomic_write_text(path: str, text: str, *, overwrite: bool = True) -> None:
  atomic_write_bytes(path, text.encode("utf-8"), overwrite=overwrite)


def write_inside(directory: str, name: str, text: str) -> None:
  """The file `name` of an output being written in `directory` (from `atomic_directory`): atomically on a local
  disk; under a gs:// staging prefix one object, written whole (the prefix is published only once complete)."""
  path = paths.join(directory, name)
  if not paths.is_remote(path):
    atomic_write_text(path, text)
    return
  try:
    objects.write(path, text.encode("utf-8"))
  except (OSError, ValueError, RuntimeError) as e:
    raise errors.InputError(f"cannot write {path!r}: {errors.first_line(e)[:300]}") from None


@contextlib.contextmanager
def atomic_directory(dst: str, *, overwrite: bool = False) -> Iterator[str]:
  """Yields a temporary directory beside `dst`; on success it takes `dst`'s place in one rename.

  Run it inside `destination.claim(dst, ...)`, which checks DST against the inputs and locks it. An existing
  `dst` is refused unless `overwrite` (checked again at the final rename: a DST that appeared meanwhile is
  never replaced without it); the previous `dst` survives any failure before the final rename. On failure only
  the temporary directory can be left behind (after a SIGKILL), and the next run on DST removes it.
  """
  if paths.is_remote(dst):  # no rename on object stores: staged, then published with a commit marker

    with object_store.staged_directory(dst, overwrite=overwrite) as tmp:
      yield tmp
    return
  dst = destination.absolute(dst)
  check_umask(dst)
  destination.check_replace(dst, overwrite)
  parent = os.path.dirname(dst)
  if not os.path.isdir(parent):
    raise errors.InputError(f"cannot write {dst!r}: directory {parent!r} does not exist")
  try:
    tmp = tempfile.mkdtemp(prefix=destination.temp_prefix(dst), dir=parent)
  except OSError as e:
    raise errors.InputError(_os_error_message(dst, e)) from None
  try:
    os.chmod(tmp, 0o777 & ~_umask())
    with open(os.path.join(tmp, destination.TMP_MARKER), "w", encoding="utf-8") as f:
      f.write(f"{os.getpid()}\n")
  except OSError as e:  # a full disk: the directory was made, its marker could not be written
    trees.remove_tree(tmp)
    raise errors.InputError(_os_error_message(dst, e)) from None
  cleanup = stop.add_cleanup(lambda: trees.remove_tree(tmp))  # if a stop cannot wait for us
  try:
    yield tmp
    stop.check()  # a stopped run never commits, even if its signal's exception was swallowed
    os.unlink(os.path.join(tmp, destination.TMP_MARKER))
    _fsync_tree(tmp)
    test_point("swap")
    stop.check()
    if os.path.lexists(dst):
      destination.check_replace(dst, overwrite)  # it may have appeared (or changed) while we worked
      _check_removable(dst)
      _swap_into_place(tmp, dst)
      test_point("swapped")
      trees.remove_tree(tmp)  # now holds the previous dst
    else:
      _rename_no_replace(tmp, dst, overwrite)
  except OSError as e:
    trees.remove_tree(tmp)
    raise errors.InputError(_io_error_message(dst, tmp, e)) from None
  except BaseException:
    trees.remove_tree(tmp)
    raise
  finally:
    stop.remove_cleanup(cleanup)


def _io_error_message(dst: str, tmp: str, e: OSError) -> str:
  """Names the output for errors writing it (or a full disk), and the file otherwise (a source being read)."""
  name = os.path.abspath(e.filename) if isinstance(e.filename, str) else None
  writing = name is None or name.startswith(tmp) or name.startswith(dst)
  if writing or e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS):
    return _os_error_message(dst, e)
  return f"cannot read {name!r}: {e.strerror or type(e).__name__}"


FALLBACK_ENV = "INSPECT_ATOMIC_NO_RENAMEAT2"  # tests: use the two-rename fallback instead of renameat2



_RENAME_NOREPLACE, _RENAME_EXCHANGE = 1, 2


def _renameat2(src: str, dst: str, flags: int) -> bool:
  """Linux renameat2(2); False where it is unavailable (other libc, old kernel, unsupported file system)."""
  if os.environ.get(FALLBACK_ENV):
    return False

  libc = ctypes.CDLL(None, use_errno=True)
  renameat2 = getattr(libc, "renameat2", None)
  if renameat2 is None:
    return False
  at_fdcwd = -100
  if renameat2(at_fdcwd, src.encode(), at_fdcwd, dst.encode(), flags) == 0:
    return True
  err = ctypes.get_errno()
  if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
    return False
  raise OSError(err, os.strerror(err), dst)


def _rename_no_replace(tmp: str, dst: str, overwrite: bool) -> None:
  """Moves `tmp` to the absent `dst`; a `dst` created in the meantime is never replaced."""
  try:
    if _renameat2(tmp, dst, _RENAME_NOREPLACE):
      return
  except FileExistsError:
    pass
  if os.path.lexists(dst):
    destination.check_replace(dst, overwrite)
    _swap_into_place(tmp, dst)
    trees.remove_tree(tmp)
    return
  os.rename(tmp, dst)


def _check_removable(dst: str) -> None:
  """Refuses (before the swap) a previous DST that this process could not remove afterwards: a directory in it
  that is neither writable by us nor ours to make writable."""
  for directory in trees.directories(dst):
    with contextlib.suppress(OSError):
      if not os.access(directory, os.W_OK | os.X_OK) and os.lstat(directory).st_uid != os.geteuid():
        raise errors.InputError(f"cannot replace {dst!r}: {directory!r} is not writable and not yours, so the "
                                "previous output could not be removed; accepted: --output of a directory you can "
                                "remove, or make it writable first")


def _swap_into_place(tmp: str, dst: str) -> None:
  """Atomically exchanges `tmp` and `dst` (Linux renameat2), so `dst` is never absent.

  Where the exchange is unavailable: rename `dst` aside, then `tmp` in; if the second rename fails the
  previous `dst` is put back. A kill between the two leaves `<tmp>.old`, which the next run puts back
  (`destination.reclaim_stale_temporaries`).
  """
  if _renameat2(tmp, dst, _RENAME_EXCHANGE):
    return
  aside = tmp + ".old"
  os.rename(dst, aside)
  try:
    test_point("swap-aside")
    os.rename(tmp, dst)
  except BaseException:
    os.rename(aside, dst)
    raise
  os.rename(aside, tmp)


def _fsync_tree(root: str) -> None:
  for directory, _, files in os.walk(root):
    for name in files:
      with contextlib.suppress(OSError):
        fd = os.open(os.path.join(directory, name), os.O_RDONLY)
        try:
          os.fsync(fd)
        finally:
          os.close(fd)
