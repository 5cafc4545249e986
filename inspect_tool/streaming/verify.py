"""The merged checkpoint checked before it is committed: every process's database, every array, every chunk.

After process 0 merges the processes' OCDBT databases (`orbax_writer.OrbaxArrayWriter.finalize`), `check_merged`
reads the root database's listing: each array must have its `zarr.json` with the planned shape and dtype, and
every chunk of its grid stored (a chunk some process was meant to write and did not reads as zeros, silently);
then one chunk of each array is read back and decoded: its smallest (the last along every axis; in a sharded
array, the last inner chunk of the last shard), through the merged root reopened with mapped reads where the
directory is on a local disk, several arrays at once while memory holds no more than the largest read alone
(`_read_back`). Any fault (a listing or a read that fails) is one line naming what failed; the temporary directory
is then removed and DST left as it was.
"""

from __future__ import annotations

import collections
import json
import math

import numpy as np
import tensorstore as ts

from inspect_tool import errors


def check_databases(kvstore: dict, items_dir: str, process_dir: str, count: int, context) -> None:
  """Every process's database (`process_dir.format(i)`, i < `count`) under the items' directory (its kvstore spec,
  local or gs://; `items_dir` names it) exists and has its manifest."""
  try:
    store = ts.KvStore.open(kvstore, context=context).result()
    found = [store.read(f"{process_dir.format(i)}/manifest.ocdbt") for i in range(count)]
    missing = [i for i, read in enumerate(found) if read.result().state != "value"]
  except Exception as e:  # pylint: disable=broad-except
    raise errors.CheckpointError(f"the databases of {items_dir} cannot be listed ({errors.first_line(e)}); nothing "
                                 "was committed") from None
  if missing:
    raise errors.CheckpointError(f"the databases of process(es) {', '.join(map(str, missing))} are missing from "
                                 f"the checkpoint being written ({count} processes); nothing was committed")


def check_merged(root_kvstore, specs: dict, context, *, complete: bool = True) -> None:
  """`specs`: array key → (shape, dtype, chunk) of every array written; `root_kvstore` the merged database."""
  try:
    stored, metadata = _listing(root_kvstore)
  except Exception as e:  # pylint: disable=broad-except
    raise errors.CheckpointError(f"the merged checkpoint cannot be listed ({errors.first_line(e)}); nothing was "
                                 "committed") from None
  checks = []
  for key, (shape, dtype, chunk) in sorted(specs.items()):
    path = ".".join(key)
    where = f"array {'/'.join(key)} of the merged checkpoint"
    if path not in metadata:
      raise errors.CheckpointError(f"{where} has no metadata; nothing was committed")
    meta = json.loads(metadata[path])
    if list(meta.get("shape", [])) != list(shape) or meta.get("data_type") != str(dtype):
      raise errors.CheckpointError(f"{where} is {meta.get('data_type')} {meta.get('shape')}, planned {dtype} "
                                   f"{list(shape)}; nothing was committed")
    grid = meta.get("chunk_grid", {}).get("configuration", {}).get("chunk_shape", chunk)
    expected = math.prod(-(-int(d) // max(1, int(c))) for d, c in zip(shape, grid)) if shape else 1
    if stored.get(path, 0) != expected and (complete or stored.get(path, 0) > expected):
      raise errors.CheckpointError(f"{where} has {stored.get(path, 0)} of its {expected} chunks; nothing was "
                                   "committed")
    opened = ts.open({"driver": "zarr3"}, kvstore=root_kvstore / (path + "/"), open=True, context=context)
    index = last_chunk(shape, grid, _inner_chunk(meta))
    nbytes = math.prod(s.stop - s.start for s in index) * np.dtype(dtype).itemsize
    checks.append((where, index, nbytes, opened))
  _read_back(checks)


def _listing(root_kvstore) -> tuple[dict[str, int], dict[str, bytes]]:
  """The stored chunks per array path and each array's `zarr.json` in the merged database."""
  stored: dict[str, int] = {}
  metadata: dict[str, bytes] = {}
  for raw in root_kvstore.list().result():
    name = raw.decode()
    path, _, leaf = name.rpartition("/zarr.json")
    if not leaf and path:
      metadata[path] = root_kvstore.read(name).result().value
      continue
    prefix, sep, _ = name.partition("/c")
    if sep:
      stored[prefix] = stored.get(prefix, 0) + 1
  return stored, metadata


def _read_back(checks) -> None:
  """Reads and decodes each (where, index, decoded bytes, array being opened) of `checks`, in order, several at
  once while their decoded bytes together are no more than the largest one's (memory never holds more than one
  read at a time would)."""
  limit = max((nbytes for _, _, nbytes, _ in checks), default=0)
  in_flight: collections.deque = collections.deque()

  def finish_oldest() -> None:
    where, read, _ = in_flight.popleft()
    try:
      read.result()
    except Exception as e:  # pylint: disable=broad-except
      raise _unreadable(where, e) from None

  for where, index, nbytes, opened in checks:
    while in_flight and sum(size for _, _, size in in_flight) + nbytes > limit:
      finish_oldest()
    try:
      in_flight.append((where, _read(opened, index), nbytes))
    except Exception as e:  # pylint: disable=broad-except
      raise _unreadable(where, e) from None
  while in_flight:
    finish_oldest()


def _unreadable(where: str, e: BaseException) -> errors.CheckpointError:
  return errors.CheckpointError(f"{where} cannot be read back ({errors.first_line(e)}); nothing was committed")


def last_chunk(shape, grid, inner=None) -> tuple[slice, ...]:
  """The last chunk of the grid `grid` over `shape` along every axis (no larger than any other); with `inner`, the
  last inner chunk of that (sharded) chunk."""
  index = []
  for axis, (d, c) in enumerate(zip(shape, grid)):
    d, c = int(d), max(1, int(c))
    start = (d - 1) // c * c if d else 0
    if inner is not None:
      i = max(1, int(inner[axis]))
      start += (d - start - 1) // i * i if d > start else 0
    index.append(slice(start, d))
  return tuple(index)


def _inner_chunk(meta: dict):
  """The inner chunk shape of a `sharding_indexed` zarr3 array (its first codec), else None."""
  codecs = meta.get("codecs") or [{}]
  if codecs[0].get("name") != "sharding_indexed":
    return None
  return codecs[0].get("configuration", {}).get("chunk_shape")


def _read(opened, index):
  """The read of `index` from the array being opened (`opened`, a future), started."""
  store = opened.result()
  return (store[index] if index else store).read()
