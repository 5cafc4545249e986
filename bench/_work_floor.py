"""The floor of an export's work, for `bench_export.py`: tensorstore's decode-only read of a source (every chunk once,
`IN_FLIGHT` at a time, discarded) and its encode-only write of an export's arrays (their metadata, values loaded
first); each prints "FLOOR wall cpu bytes chunks" for its timed part (not the process's start-up)."""

from __future__ import annotations

import collections
import itertools
import json
import os
import time

IN_FLIGHT = 2  # chunk reads or writes the floor cases keep in flight


def stored_arrays(items: str, context=None) -> dict:
  """name -> (opened zarr3 array, its zarr.json metadata) of every array of an Orbax OCDBT pytree directory."""
  import tensorstore as ts  # pylint: disable=import-outside-toplevel

  base = {"driver": "file", "path": os.path.abspath(items) + "/"}
  kv = ts.KvStore.open({"driver": "ocdbt", "base": base}, context=context).result()
  keys = [k for k in kv.list().result() if k.endswith(b"/zarr.json")]
  metas = [json.loads(kv.read(k).result().value) for k in keys]
  names = [k.decode().rsplit("/zarr.json", 1)[0] for k in keys]
  opened = [ts.open({"driver": "zarr3", "kvstore": dict(driver="ocdbt", base=base, path=n + "/")}, open=True,
                    context=context) for n in names]
  return {n: (f.result(), m) for n, f, m in zip(names, opened, metas)}


def _blocks(shape, chunk):
  """Index tuples of every chunk-aligned block of `shape`, in C order."""
  ranges = [range(0, d, max(1, c)) for d, c in zip(shape, chunk)]
  for starts in itertools.product(*ranges):
    yield tuple(slice(s, min(s + max(1, c), d)) for s, c, d in zip(starts, chunk, shape))


def _drain(pending: collections.deque, keep: int) -> int:
  done = 0
  while len(pending) > keep:
    got = pending.popleft().result()
    done += getattr(got, "nbytes", 0)
  return done


def read_floor(step_dir: str) -> None:
  """Decode-only read: every chunk of the source once (whole read chunks, `IN_FLIGHT` at a time), discarded."""
  from inspect_tool.streaming import orbax_writer  # pylint: disable=import-outside-toplevel

  start, cpu = time.perf_counter(), time.process_time()
  pending, nbytes, chunks = collections.deque(), 0, 0
  for store, _ in stored_arrays(os.path.join(step_dir, "items"), orbax_writer.ts_context()).values():
    for index in _blocks(store.shape, store.chunk_layout.read_chunk.shape):
      pending.append(store[index].read() if index else store.read())
      chunks += 1
      nbytes += _drain(pending, IN_FLIGHT - 1)
  nbytes += _drain(pending, 0)
  print(f"FLOOR {time.perf_counter() - start:.3f} {time.process_time() - cpu:.3f} {nbytes} {chunks}")


def write_floor(export_step: str, dst_step: str) -> None:
  """Encode-only write: the export's arrays (loaded first, untimed) written with their metadata (dtype, chunks,
  codecs) into a new OCDBT database, chunk by chunk, `IN_FLIGHT` at a time."""
  import tensorstore as ts  # pylint: disable=import-outside-toplevel
  from inspect_tool.streaming import orbax_writer  # pylint: disable=import-outside-toplevel

  context = orbax_writer.ts_context()
  found = stored_arrays(os.path.join(export_step, "items"))
  arrays = [(n, m, s.read().result()) for n, (s, m) in sorted(found.items())]
  base = {"driver": "file", "path": os.path.join(os.path.abspath(dst_step), "items") + "/"}
  start, cpu = time.perf_counter(), time.process_time()
  specs = [{"driver": "zarr3", "kvstore": dict(driver="ocdbt", base=base, path=n + "/"),
            "metadata": {k: v for k, v in m.items() if k not in ("attributes", "dimension_names")},
            "store_data_equal_to_fill_value": True} for n, m, _ in arrays]
  stores = [f.result() for f in [ts.open(spec, create=True, open=True, context=context) for spec in specs]]
  pending, nbytes, chunks = collections.deque(), 0, 0
  for store, (_, _, value) in zip(stores, arrays):
    for index in _blocks(value.shape, store.chunk_layout.write_chunk.shape):
      pending.append(store[index].write(value[index]) if index else store.write(value))
      chunks += 1
      nbytes += value[index].nbytes
      _drain(pending, IN_FLIGHT - 1)
  _drain(pending, 0)
  print(f"FLOOR {time.perf_counter() - start:.3f} {time.process_time() - cpu:.3f} {nbytes} {chunks}")
