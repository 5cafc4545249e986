"""Removing a directory tree of ours, read-only parts included."""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
from typing import Iterator


def directories(root: str) -> Iterator[str]:
  """`root` and every directory below it (symbolic links not followed), each before what it holds."""
  yield root
  with contextlib.suppress(OSError):
    for entry in os.scandir(root):
      if entry.is_dir(follow_symlinks=False):
        yield from directories(entry.path)


def _grant_owner(directory: str) -> None:
  """Gives the owner's rwx back to a directory of ours that lacks it (so that what it holds can be removed)."""
  with contextlib.suppress(OSError):
    st = os.lstat(directory)
    if stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and st.st_mode & 0o700 != 0o700:
      os.chmod(directory, stat.S_IMODE(st.st_mode) | 0o700)


def remove_tree(path: str) -> None:
  """Removes a directory tree of ours, read-only parts included (a read-only previous export, a temporary
  directory made under a umask that took the owner's permissions); what cannot be removed stays."""
  if os.path.isdir(path) and not os.path.islink(path):
    for directory in directories(path):
      _grant_owner(directory)
  shutil.rmtree(path, ignore_errors=True)
