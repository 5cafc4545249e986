"""Objects under a gs:// prefix: list, read, write (create-only too), stream an upload, compose, copy, delete.

Reads and writes go through tensorstore's `gcs` kvstore (`paths.kvstore_spec`; a create-only write is a write
conditional on "no object", GCS's `ifGenerationMatch=0`); listings (by prefix), streamed uploads (resumable),
server-side copies (GCS `rewrite`), compositions (GCS `compose`) and deletions through gcsfs, the file system under
Orbax's `epath`. No HTTP client of our own. Names are relative to the prefix they are listed or written under.
"""

from __future__ import annotations

from typing import Iterable, Sequence

from inspect_tool import errors
from inspect_tool.storage import paths
from inspect_tool.storage import remote

NO_OBJECT = b"\x02"  # tensorstore's storage generation of a missing key: a write `if_equal` to it creates only


def _kvstore(prefix: str):
  # lazy: tensorstore, ~0.1 s to import: `hf --path`, `hf --summary` load this module without it
  import tensorstore as ts  # pylint: disable=import-outside-toplevel


  return ts.KvStore.open(paths.kvstore_spec(prefix), context=remote.context()).result()


def filesystem():
  """gcsfs's file system, without listing caches (another process's writes must show at once)."""
  # lazy: fsspec, ~0.1 s to import: `orbax --path`, `hf --path` load this module without it
  import fsspec  # pylint: disable=import-outside-toplevel

  paths.configure()
  return fsspec.filesystem("gs", use_listings_cache=False, skip_instance_cache=True)


def _fs_path(url: str) -> str:
  return url[len(paths.GS):]


def names(prefix: str) -> list[str]:
  """The names of the objects under `prefix/` (relative to it), sorted; [] when there are none."""
  return names_from(prefix, "")


def names_from(prefix: str, start: str) -> list[str]:
  """The names under `prefix/` that begin with `start` (a prefix listing, through gcsfs), sorted."""
  bucket, name = paths.split(paths.normalize(prefix))
  root = f"{bucket}/{name}/" if name else f"{bucket}/"
  try:
    found = filesystem().find(root, prefix=start)
  except FileNotFoundError:
    return []
  return sorted(path[len(root):] for path in found if path.startswith(root + start))


def exists(url: str) -> bool:
  """Whether the object `url` exists, asked now (no listing cache: the answer may change while a process runs),
  within `remote.timeout_s()`; a failure is `remote.error`'s one line."""
  try:
    return filesystem().info(_fs_path(url), timeout=remote.timeout_s())["type"] == "file"
  except FileNotFoundError:
    return False
  except errors.InspectError:
    raise
  except Exception as e:  # pylint: disable=broad-except
    raise remote.error(url, e) from None


def read(url: str) -> tuple[bytes | None, bytes]:
  """(The object's bytes or None when it does not exist, its generation: `NO_OBJECT` when missing)."""
  result = _kvstore(paths.parent(url)).read(paths.basename(url)).result()
  if result.state != "value":
    return None, NO_OBJECT
  return result.value, result.stamp.generation


def write(url: str, data: bytes, *, if_generation: bytes | None = None) -> bytes | None:
  """Writes the object `url`; with `if_generation`, only if it is still at that generation (`NO_OBJECT`: only
  if it does not exist). Returns its new generation, or None when the condition failed and nothing was written."""
  result = _kvstore(paths.parent(url)).write(paths.basename(url), data, if_equal=if_generation).result()
  if if_generation is not None and not result.generation:
    return None
  return result.generation


def delete(url: str, *, if_generation: bytes | None = None) -> None:
  _kvstore(paths.parent(url)).write(paths.basename(url), None, if_equal=if_generation).result()


def delete_all(prefix: str, names_: Iterable[str] | None = None) -> None:
  """Deletes `names_` under `prefix` (default: every object under it)."""
  names_ = names(prefix) if names_ is None else list(names_)
  if names_:
    filesystem().rm([_fs_path(paths.join(prefix, n)) for n in names_])


def copy(src_prefix: str, dst_prefix: str, names_: Iterable[str]) -> None:
  """Server-side copies (GCS rewrite: no bytes through this machine) of `names_` from one prefix to another."""
  names_ = list(names_)
  if names_:
    filesystem().copy([_fs_path(paths.join(src_prefix, n)) for n in names_],
                      [_fs_path(paths.join(dst_prefix, n)) for n in names_])


def open_write(url: str, block_size: int):
  """A stream writing the object `url` (gcsfs: held in memory up to `block_size` bytes, a multiple of 256 KiB, then
  sent as pieces of one resumable upload), complete once closed."""
  return filesystem().open(_fs_path(url), "wb", block_size=block_size)


COMPOSE_MAX = 32  # source objects per GCS compose request


def compose(url: str, parts: Sequence[str]) -> None:
  """Makes the object `url` of the objects `parts` (gs:// URLs, one bucket) in order, server side; more than
  `COMPOSE_MAX` are composed in groups first (into `url.compose-<level>-<i>`, removed afterwards)."""
  fs, level, temporaries = filesystem(), 0, []
  parts = [_fs_path(p) for p in parts]
  while len(parts) > COMPOSE_MAX:
    groups = [parts[i:i + COMPOSE_MAX] for i in range(0, len(parts), COMPOSE_MAX)]
    parts = [f"{_fs_path(url)}.compose-{level}-{i}" for i in range(len(groups))]
    for target, group in zip(parts, groups):
      fs.merge(target, group)
    temporaries += parts
    level += 1
  fs.merge(_fs_path(url), parts)
  if temporaries:
    fs.rm(temporaries)
