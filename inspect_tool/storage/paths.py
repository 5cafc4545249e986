"""Paths that may be local or on Google Cloud Storage (`gs://bucket/prefix`), one vocabulary for both.

Arrays are read and written through tensorstore's `gcs` kvstore driver (`kvstore_spec`), directory questions go
through etils `epath`, the file-system layer Orbax itself uses (gcsfs underneath): no HTTP client of our own.
Both honour the standard variables: `STORAGE_EMULATOR_HOST` (gcsfs) and `TENSORSTORE_GCS_HTTP_URL` (tensorstore);
`configure()` derives the second from the first, so that an emulator named once serves both.

A gs:// "directory" is a prefix: it exists when some object's name starts with `prefix/`.
"""

from __future__ import annotations

import logging
import os
import posixpath

GS = "gs://"
EMULATOR_ENV = "STORAGE_EMULATOR_HOST"
TENSORSTORE_URL_ENV = "TENSORSTORE_GCS_HTTP_URL"


def is_remote(path: str | os.PathLike) -> bool:
  """Whether `path` names an object-store location (gs://)."""
  return os.fspath(path).startswith(GS)


def split(path: str) -> tuple[str, str]:
  """(bucket, object prefix without a trailing slash) of a gs:// path."""
  bucket, _, name = path[len(GS):].partition("/")
  return bucket, name.strip("/")


def normalize(path: str | os.PathLike) -> str:
  """A local path as `os.path.normpath` gives it; a gs:// path with `.`/`..`/double slashes resolved, no
  trailing slash (`os.path.normpath` would turn `gs://b` into `gs:/b`)."""
  path = os.fspath(path)
  if not is_remote(path):
    return os.path.normpath(path)
  bucket, name = split(path)
  name = posixpath.normpath("/" + name).lstrip("/") if name else ""
  return f"{GS}{bucket}/{name}" if name else f"{GS}{bucket}"


def join(path: str, *parts: str) -> str:
  if not is_remote(path):
    return os.path.join(path, *parts)
  return "/".join([path.rstrip("/"), *(p.strip("/") for p in parts if p)])


def parent(path: str) -> str:
  if not is_remote(path):
    return os.path.dirname(os.path.normpath(path))
  bucket, name = split(normalize(path))
  return normalize(f"{GS}{bucket}/{posixpath.dirname(name)}")


def basename(path: str) -> str:
  if not is_remote(path):
    return os.path.basename(os.path.normpath(path))
  return split(normalize(path))[1].rpartition("/")[2]


def absolute(path: str) -> str:
  """An absolute local path, a normalized gs:// one."""
  return normalize(path) if is_remote(path) else os.path.abspath(path)


def configure() -> None:
  """Points tensorstore at `STORAGE_EMULATOR_HOST` when that is set and `TENSORSTORE_GCS_HTTP_URL` is not, and
  quiets gcsfs's logging (per-call warnings about bucket types; tracebacks of failures that `storage.remote` turns
  into one line of its own)."""
  host = os.environ.get(EMULATOR_ENV)
  if host and not os.environ.get(TENSORSTORE_URL_ENV):
    os.environ[TENSORSTORE_URL_ENV] = host if "://" in host else f"http://{host}"
  for name in ("gcsfs", "gcsfs.core", "gcsfs.retry", "google.auth", "google.auth._default"):
    logging.getLogger(name).setLevel(logging.CRITICAL)


def kvstore_spec(path: str) -> dict:
  """tensorstore's kvstore spec for the directory `path` (a trailing slash: its keys are the names under it)."""
  if is_remote(path):
    configure()
    bucket, name = split(path)
    return {"driver": "gcs", "bucket": bucket, "path": f"{name}/" if name else ""}
  return {"driver": "file", "path": os.path.abspath(path) + "/"}


def epath(path: str):
  """`etils.epath.Path` of `path` (gs:// through gcsfs)."""
  configure()
  # lazy: etils.epath, ~0.05 s to import: `orbax --path`, `hf --path` load this module without it
  from etils import epath as epath_lib  # pylint: disable=import-outside-toplevel
  return epath_lib.Path(path)
