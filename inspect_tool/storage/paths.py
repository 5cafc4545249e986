"""Paths that may be local or on Google Cloud Storage (`gs://bucket/prefix`), one vocabulary for both.

Arrays are read and written through tensorstore's `gcs` kvstore driver (`kvstore_spec`), directory questions go
through etils `epath`, the file-system layer Orbax itself uses (gcsfs underneath): no HTTP client of our own.
Both honour the standard variables: `STORAGE_EMULATOR_HOST` (gcsfs) and `TENSORSTORE_GCS_HTTP_URL` (tensorstore);
`configure()` derives the second from the first, so that an emulator named once serves both.

A gs:// "directory" is a prefix: it exists when some object's name starts with `prefix/`. Read-only sources named by
URL (`http://`, `https://`, `hf://ORG/REPO[@REVISION]`: `storage.web`) share the same vocabulary of names:
`normalize`, `join`, `parent` and `basename` treat them as gs:// paths are treated.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import posixpath

from inspect_tool.storage import mapped_reads

GS = "gs://"
WEB = ("http://", "https://", "hf://")  # read-only sources (`storage.web`)
EMULATOR_ENV = "STORAGE_EMULATOR_HOST"
TENSORSTORE_URL_ENV = "TENSORSTORE_GCS_HTTP_URL"


def is_remote(path: str | os.PathLike) -> bool:
  """Whether `path` names an object-store location (gs://)."""
  return os.fspath(path).startswith(GS)


def is_web(path: str | os.PathLike) -> bool:
  """Whether `path` names a read-only source by URL: http://, https:// or hf:// (`storage.web`)."""
  return os.fspath(path)[:8].lower().startswith(WEB)


def is_url(path: str | os.PathLike) -> bool:
  """Whether `path` is a location by URL (gs://, or a read-only web source): no local file system beneath it."""
  return is_remote(path) or is_web(path)


def _url_parts(path: str) -> tuple[str, str, str]:
  """(scheme://, root: a bucket, host or Hub organisation, the name below it without slashes at its ends)."""
  scheme, _, rest = path.partition("://")
  root, _, name = rest.partition("/")
  return scheme.lower() + "://", root, name.strip("/")


def split(path: str) -> tuple[str, str]:
  """(bucket, object prefix without a trailing slash) of a gs:// path."""
  bucket, _, name = path[len(GS):].partition("/")
  return bucket, name.strip("/")


def normalize(path: str | os.PathLike) -> str:
  """A local path as `os.path.normpath` gives it; a gs:// path with `.`/`..`/double slashes resolved, no
  trailing slash (`os.path.normpath` would turn `gs://b` into `gs:/b`)."""
  path = os.fspath(path)
  if not is_url(path):
    return os.path.normpath(path)
  scheme, root, name = _url_parts(path)
  name = posixpath.normpath("/" + name).lstrip("/") if name else ""
  return f"{scheme}{root}/{name}" if name else f"{scheme}{root}"


def join(path: str, *parts: str) -> str:
  if not is_url(path):
    return os.path.join(path, *parts)
  return "/".join([path.rstrip("/"), *(p.strip("/") for p in parts if p)])


def parent(path: str) -> str:
  if not is_url(path):
    return os.path.dirname(os.path.normpath(path))
  scheme, root, name = _url_parts(normalize(path))
  return normalize(f"{scheme}{root}/{posixpath.dirname(name)}")


def basename(path: str) -> str:
  if not is_url(path):
    return os.path.basename(os.path.normpath(path))
  return _url_parts(normalize(path))[2].rpartition("/")[2]


def absolute(path: str) -> str:
  """An absolute local path, a normalized gs:// (or http://, https://, hf://) one."""
  return normalize(path) if is_url(path) else os.path.abspath(path)


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


@dataclasses.dataclass(frozen=True, eq=False)
class Place:
  """A directory resolved once (`place`): the floors below read its fields and name what lies under it by
  `f"{place.path}/{name}"`, without parsing the string again."""

  path: str  # absolute local path, or normalized gs:// URL (no trailing slash)
  remote: bool  # gs://
  kvstore: dict  # tensorstore's kvstore spec of the directory (`kvstore_spec`)
  read_kvstore: dict  # the same for reading: a local directory's files mapped where allowed (`mapped_reads`)


def place(path: str) -> Place:
  """`path` resolved: absolute (or normalized), local or remote, and its kvstore specs."""
  path = absolute(path)
  spec = kvstore_spec(path)
  return Place(path, is_remote(path), spec, mapped_reads.kvstore_spec(spec, path))


def epath(path: str):
  """`etils.epath.Path` of `path` (gs:// through gcsfs)."""
  configure()
  # lazy: etils.epath, ~0.05 s to import: `orbax --path`, `hf --path` load this module without it
  from etils import epath as epath_lib  # pylint: disable=import-outside-toplevel
  return epath_lib.Path(path)
