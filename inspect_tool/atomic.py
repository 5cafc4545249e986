"""Atomic output: files and directories appear complete or not at all (temporary path, then rename)."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import tempfile
from typing import Iterator

from inspect_tool import errors


def _os_error_message(path: str, e: OSError) -> str:
  reason = {errno.ENOSPC: "no space left on device", errno.EACCES: "permission denied",
            errno.EROFS: "read-only file system", errno.ENOENT: "directory does not exist"}.get(
                e.errno, e.strerror or type(e).__name__)
  return f"cannot write {path!r}: {reason}"


def _umask() -> int:
  mask = os.umask(0)
  os.umask(mask)
  return mask


def atomic_write_bytes(path: str, data: bytes) -> None:
  """Writes `data` to `path` through a temporary file in the same directory and a rename."""
  directory = os.path.dirname(os.path.abspath(path))
  try:
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory)
  except OSError as e:
    raise errors.InputError(_os_error_message(path, e)) from None
  try:
    os.chmod(tmp, 0o666 & ~_umask())  # mkstemp creates 0600; give the file the permissions open() would
    with os.fdopen(fd, "wb") as f:
      f.write(data)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  except OSError as e:
    with contextlib.suppress(OSError):
      os.unlink(tmp)
    raise errors.InputError(_os_error_message(path, e)) from None
  except BaseException:
    with contextlib.suppress(OSError):
      os.unlink(tmp)
    raise


def atomic_write_text(path: str, text: str) -> None:
  atomic_write_bytes(path, text.encode("utf-8"))


@contextlib.contextmanager
def atomic_directory(dst: str, *, overwrite: bool = False) -> Iterator[str]:
  """Yields a temporary directory beside `dst`; on success it replaces `dst` in one rename.

  An existing `dst` is refused unless `overwrite`; it survives any failure before the final rename.
  On failure (or a kill) only a hidden `.<name>.tmp-*` directory can be left behind, never a partial `dst`.
  """
  dst = os.path.abspath(dst)
  if os.path.exists(dst) and not overwrite:
    raise errors.InputError(f"output {dst!r} already exists; pass --overwrite to replace it")
  parent = os.path.dirname(dst)
  if not os.path.isdir(parent):
    raise errors.InputError(f"cannot write {dst!r}: directory {parent!r} does not exist")
  try:
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(dst)}.tmp-", dir=parent)
    os.chmod(tmp, 0o777 & ~_umask())
  except OSError as e:
    raise errors.InputError(_os_error_message(dst, e)) from None
  try:
    yield tmp
    _fsync_tree(tmp)
    if os.path.exists(dst):
      _swap_into_place(tmp, dst)
      shutil.rmtree(tmp, ignore_errors=True)  # now holds the previous dst
    else:
      os.replace(tmp, dst)
  except OSError as e:
    shutil.rmtree(tmp, ignore_errors=True)
    raise errors.InputError(_os_error_message(dst, e)) from None
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise


_RENAME_EXCHANGE = 2


def _swap_into_place(tmp: str, dst: str) -> None:
  """Atomically exchanges `tmp` and `dst` (Linux renameat2), so `dst` is never absent.

  Where the exchange is unavailable, falls back to rename-aside then rename-in (a short window without dst).
  """
  import ctypes  # pylint: disable=import-outside-toplevel

  libc = ctypes.CDLL(None, use_errno=True)
  renameat2 = getattr(libc, "renameat2", None)
  if renameat2 is not None:
    at_fdcwd = -100
    if renameat2(at_fdcwd, tmp.encode(), at_fdcwd, dst.encode(), _RENAME_EXCHANGE) == 0:
      return
  aside = tmp + ".old"
  os.replace(dst, aside)
  os.replace(tmp, dst)
  os.replace(aside, tmp)


def _fsync_tree(root: str) -> None:
  for directory, _, files in os.walk(root):
    for name in files:
      with contextlib.suppress(OSError):
        fd = os.open(os.path.join(directory, name), os.O_RDONLY)
        try:
          os.fsync(fd)
        finally:
          os.close(fd)
