"""Reading gs:// objects with bounded waits, and Cloud Storage failures as one line naming the path.

Directory questions (what is at a path, what is under a prefix) and small objects go through gcsfs (fsspec), each
call bounded to `timeout_s()` seconds (`INSPECT_GCS_TIMEOUT`, default 60), inside which gcsfs makes its own 6 tries
(about 35 s against a closed port). Byte ranges (safetensors headers and tensors) and array stores
go through tensorstore's `gcs` kvstore, with `context()` bounding its retries to `RETRIES` tries (its default is 32,
backing off up to a minute each: minutes of silence). Failures become `errors.CheckpointError` lines: no such
bucket, permission denied (HTTP 401/403), storage unreachable (after how many tries or seconds), anything else
quoted in one line.
"""

from __future__ import annotations

import functools
import os
import re

from inspect_tool import errors
from inspect_tool.storage import paths

TIMEOUT_ENV = "INSPECT_GCS_TIMEOUT"
DEFAULT_TIMEOUT_S = 60.0
RETRIES = 4
REQUEST_RETRIES = {"max_retries": RETRIES, "initial_delay": "0.5s", "max_delay": "4s"}  # tensorstore's resource
_DENIED = re.compile(r"PERMISSION_DENIED|UNAUTHENTICATED|Forbidden|Unauthorized|Invalid Credentials|"
                     r"does not have storage\.", re.I)
_UNREACHABLE = re.compile(r"retry attempts failed|(?:Could not|Couldn't|Cannot) connect|CURL error|UNAVAILABLE", re.I)


def timeout_s(env: str = TIMEOUT_ENV, default: float = DEFAULT_TIMEOUT_S) -> float:
  """Seconds one gcsfs call may take (`INSPECT_GCS_TIMEOUT`, a positive number; default 60), or what `env` says."""
  text = os.environ.get(env, "")
  try:
    value = float(text) if text else default
  except ValueError:
    value = 0.0
  if not 0 < value < float("inf"):
    raise errors.InputError(f"{env}={errors.shown(text)} is not a number of seconds; accepted: a positive number")
  return value


def endpoint(tensorstore: bool = False) -> str:
  """The Cloud Storage service gcsfs (or tensorstore) talks to: the emulator's address when one is named."""
  named = os.environ.get(paths.TENSORSTORE_URL_ENV) if tensorstore else None
  return named or os.environ.get(paths.EMULATOR_ENV) or "https://storage.googleapis.com"


@functools.lru_cache(maxsize=None)
def context():
  """The process's tensorstore `Context` for gs:// stores: gcs requests give up after `RETRIES` tries. One, kept for
  the process: a fresh context per store made tensorstore 0.1.86 fail now and then to read an OCDBT manifest from
  gcs after a local OCDBT store was read and dropped ("Malformed StorageGeneration")."""
  # lazy: tensorstore, ~0.1 s to import: `hf --path`, `hf --summary` load this module without it
  import tensorstore as ts  # pylint: disable=import-outside-toplevel
  paths.configure()
  return ts.Context({"gcs_request_retries": REQUEST_RETRIES})


def error(path: str, e: BaseException, *, tensorstore: bool = False) -> errors.CheckpointError:
  """The one line for a failed read of `path` (an exception from gcsfs, or from `tensorstore`)."""
  # lazy: fsspec, ~0.1 s to import: `orbax --path`, `hf --path` load this module without it
  from fsspec import exceptions as fs_exceptions  # pylint: disable=import-outside-toplevel
  text = errors.first_line(e)
  tries = re.search(r"All (\d+) retry attempts failed", text)
  if isinstance(e, (fs_exceptions.FSTimeoutError, TimeoutError)):
    return errors.CheckpointError(f"{path}: Cloud Storage at {endpoint()} did not answer; gave up after "
                                  f"{timeout_s():g} s ({TIMEOUT_ENV} sets the limit)")
  if isinstance(e, PermissionError) or _DENIED.search(text):
    return errors.CheckpointError(f"{path}: permission denied by Cloud Storage ({text})")
  if _UNREACHABLE.search(text) or isinstance(e, ConnectionError):
    count = tries.group(1) if tries else None if tensorstore else getattr(_fs(), "retries", None)  # gcsfs: 6
    after = f"; gave up after {count} tries" if count else ""
    return errors.CheckpointError(f"{path}: cannot reach Cloud Storage at {endpoint(tensorstore)}{after} "
                                  f"({text})")
  return errors.CheckpointError(f"{path}: cannot be read from Cloud Storage ({text})")


def _fs():
  paths.configure()
  # lazy: fsspec, ~0.1 s to import: `orbax --path`, `hf --path` load this module without it
  import fsspec  # pylint: disable=import-outside-toplevel
  return fsspec.filesystem("gs")


def _name(path: str) -> str:
  """gcsfs's `bucket/name` of `path`; a path without a bucket is refused in one line."""
  bucket, name = paths.split(paths.normalize(path))
  if not bucket:
    raise errors.CheckpointError(f"{path}: names no bucket; accepted: gs://BUCKET/PATH")
  return f"{bucket}/{name}" if name else bucket


def _call(path: str, method: str, *args, **kwargs):
  """`fs.method(*args)` within `timeout_s()`; FileNotFoundError passes through, anything else is `error`."""
  try:
    return getattr(_fs(), method)(*args, timeout=timeout_s(), **kwargs)
  except FileNotFoundError:
    raise
  except errors.InspectError:
    raise
  except Exception as e:  # pylint: disable=broad-except
    raise error(path, e) from None


def _check_bucket(path: str) -> None:
  bucket = paths.split(path)[0]
  try:
    _call(path, "info", bucket)
  except FileNotFoundError:
    raise errors.CheckpointError(f"{path}: no such bucket gs://{bucket}") from None


def kind(path: str) -> str:
  """'file', 'dir' (a prefix some object's name starts with, or a bucket) or 'missing'; a bucket that does not
  exist, a refused or unreachable service raise one line. Answered from the listing of the parent prefix (one
  request per prefix, kept for the process by gcsfs), so that resolving a directory of steps costs a request per
  directory, not several per name looked at."""
  path = paths.normalize(path)
  if "/" not in _name(path):  # the bucket itself
    _check_bucket(path)
    return "dir"
  return entries(paths.parent(path), named=path).get(paths.basename(path), "missing")


def size(path: str) -> int:
  """The byte size of the object `path` (missing: `CheckpointError`)."""
  try:
    return int(_call(path, "info", _name(path))["size"])
  except FileNotFoundError:
    _check_bucket(path)
    raise errors.CheckpointError(f"{path}: no such object") from None


def entries(path: str, named: str | None = None) -> dict[str, str]:
  """What is directly under the prefix `path`: name -> 'file' or 'dir' (a sub-prefix), sorted by name. Errors name
  `named` (default `path`)."""
  named = named or path
  try:
    found = _call(named, "ls", _name(path), detail=True)
  except FileNotFoundError:
    _check_bucket(named)
    return {}
  kinds = {entry["name"].rstrip("/").rpartition("/")[2]: "file" if entry.get("type") == "file" else "dir"
           for entry in found}
  return {name: kinds[name] for name in sorted(kinds) if name}


def listdir(path: str) -> list[str]:
  """Sorted names directly under the prefix `path` (objects and sub-prefixes)."""
  return list(entries(path))


def read_bytes(path: str, max_bytes: int, what: str = "") -> bytes:
  """The whole object `path` of at most `max_bytes`; otherwise one line naming it (worded as for a local file)."""
  label = f"{what} {path}".strip()
  found = kind(path)
  if found != "file":
    raise errors.CheckpointError(f"{label} " + ("is a directory, not a file" if found == "dir" else "does not exist"))
  total = size(path)
  if total > max_bytes:
    raise errors.CheckpointError(f"{label} is {total} bytes; files over {max_bytes} bytes are refused")
  try:
    return _call(path, "cat_file", _name(path))
  except FileNotFoundError:
    raise errors.CheckpointError(f"{label} does not exist") from None


def read_range(path: str, start: int, length: int) -> bytes:
  """`length` bytes of the object `path` from byte `start`, through tensorstore's gcs kvstore (bounded retries)."""
  # lazy: tensorstore, ~0.1 s to import: `hf --path`, `hf --summary` load this module without it
  import tensorstore as ts  # pylint: disable=import-outside-toplevel
  bucket, name = paths.split(paths.normalize(path))
  try:
    store = ts.KvStore.open({"driver": "gcs", "bucket": bucket}, context=context()).result()
    result = store.read(name, byte_range=slice(start, start + length)).result()
  except Exception as e:  # pylint: disable=broad-except
    raise error(path, e, tensorstore=True) from None
  if result.state != "value":
    raise errors.CheckpointError(f"{path}: no such object")
  return bytes(result.value)


def glob(path: str, suffix: str) -> list[str]:
  """The objects directly under the prefix `path` whose names end with `suffix`, as gs:// paths, sorted."""
  return [paths.join(path, name) for name, found in entries(path).items()
          if found == "file" and name.endswith(suffix)]
