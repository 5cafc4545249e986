"""The merged checkpoint checked before it is committed: every process's database, every array, every chunk.

After process 0 merges the processes' OCDBT databases (`orbax_writer.OrbaxArrayWriter.finalize`), `check_merged`
reads the root database's listing: each array must have its `zarr.json` with the planned shape and dtype, and
every chunk of its grid stored (a chunk some process was meant to write and did not reads as zeros, silently);
then one chunk of each array is read back and decoded. Any fault is one line naming the array; the temporary
directory is then removed and DST left as it was.
"""

from __future__ import annotations

import json
import math
import os

from inspect_tool import errors


def check_databases(items_dir: str, process_dir: str, count: int) -> None:
  """Every process's database (`process_dir.format(i)`, i < `count`) exists and has its manifest."""
  missing = [i for i in range(count)
             if not os.path.isfile(os.path.join(items_dir, process_dir.format(i), "manifest.ocdbt"))]
  if missing:
    raise errors.CheckpointError(f"the databases of process(es) {', '.join(map(str, missing))} are missing from "
                                 f"the checkpoint being written ({count} processes); nothing was committed")


def check_merged(root_kvstore, specs: dict, context, *, complete: bool = True) -> None:
  """`specs`: array key → (shape, dtype, chunk) of every array written; `root_kvstore` the merged database."""
  import tensorstore as ts  # pylint: disable=import-outside-toplevel

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
    store = ts.open({"driver": "zarr3"}, kvstore=root_kvstore / (path + "/"), open=True, context=context).result()
    first = tuple(slice(0, min(int(c), int(d))) for c, d in zip(grid, shape))
    (store[first] if first else store).read().result()
