"""Whether a local directory's files may be read by mapping them (tensorstore's `file_io_mode` "memmap").

A mapped read hands the page cache's own pages to the decoder: no copy into a freshly allocated (and zeroed)
buffer, which is most of the system time of a read through `pread`. It is used only on file systems of a local
disk or memory, where the pages are there or come from a local device. Over the network (NFS, gcsfuse and other
FUSE mounts, 9p, virtiofs) a failed page-in is a SIGBUS that ends the process without a message, so reads there
keep `pread`, whose failures are errors that say what went wrong.
"""

from __future__ import annotations

import os
import re

LOCAL_TYPES = frozenset({"ext2", "ext3", "ext4", "xfs", "btrfs", "f2fs", "zfs", "bcachefs", "jfs", "tmpfs", "ramfs",
                         "overlay"})
MOUNTINFO = "/proc/self/mountinfo"


def _unescape(field: str) -> str:
  """A mountinfo path field with its octal escapes (`\\040` for a space) decoded; other characters as they are."""
  return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), field)


def fs_type(path: str) -> str | None:
  """The type of the file system that holds `path` (its longest mount point prefix), None when unknown."""
  target = os.path.realpath(path)
  found, length = None, -1
  try:
    with open(MOUNTINFO, encoding="utf-8") as f:
      lines = f.read().splitlines()
  except OSError:
    return None
  for line in lines:
    fields = line.split()
    if "-" not in fields[6:]:
      continue
    mount, kind = _unescape(fields[4]), fields[fields.index("-", 6) + 1]
    inside = target == mount or target.startswith(mount.rstrip("/") + "/")
    if inside and len(mount) >= length:  # the later of equal mount points is the one on top
      found, length = kind, len(mount)
  return found


def allowed(path: str) -> bool:
  """Whether reads of the files under the local directory `path` may map them."""
  return fs_type(path) in LOCAL_TYPES


def kvstore_spec(spec: dict, path: str) -> dict:
  """A `file` kvstore spec for `path` with mapped reads where `allowed`; any other spec as it is."""
  if spec.get("driver") != "file" or not allowed(path):
    return spec
  return dict(spec, file_io_mode={"mode": "memmap"})
