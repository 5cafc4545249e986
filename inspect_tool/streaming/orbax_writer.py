"""The destination of an Orbax-layout export or import: zarr3 arrays in per-process OCDBT databases, written by slices.

`OrbaxArrayWriter` creates the arrays (one database commit for all), writes slices (a quantized weight's
qvalue and scale together), copies stored chunks as they are, and on process 0 merges the processes' databases
into the checkpoint's root and writes Orbax's `_METADATA`, `_sharding` and the step's `_CHECKPOINT_METADATA`.
`ts_context` is the tensorstore context every export read and write shares. The items directory may be a gs://
prefix: every process then writes its database there through tensorstore's `gcs` kvstore, and the merge, the
checks and the metadata files go there too (nothing on local disk).
"""

from __future__ import annotations

import base64
import collections
import contextlib
import json
import os
import shutil
import time
from typing import Sequence

import jax
import numpy as np
import tensorstore as ts

from inspect_tool.storage import objects
from inspect_tool.storage import paths
from inspect_tool.storage import remote
from inspect_tool.streaming import budget
from inspect_tool.streaming import verify
from quant import compat
from quant import ptq_weights

ZSTD_LEVEL = 3  # Orbax's
PROCESS_DIR = "ocdbt.process_{}"
# What a write in flight holds per byte given: tensorstore's copy of it, and its encoding (or the request's body).
IN_FLIGHT_FACTOR = 2
# Where a gs:// database closes a data file (OCDBT's `target_data_file_size`; Orbax's is 400 MiB on Cloud Storage,
# 2 GiB elsewhere): a commit is then several objects, each its own upload. On the GCS emulator 128 MiB against no
# limit shortened the writing stage in 12 of 14 alternating rounds (docs/benchmarks.md#gcs).
REMOTE_DATA_FILE_BYTES = 128 << 20


def ts_context():
  """A tensorstore context without a chunk cache (every byte read is used once), bounded copy threads and, for
  gs://, `remote.RETRIES` tries per request."""
  return ts.Context({"cache_pool": {"total_bytes_limit": 0},
                     "data_copy_concurrency": {"limit": min(os.cpu_count() or 1, 4)},
                     "file_io_concurrency": {"limit": 16}, "gcs_request_retries": remote.REQUEST_RETRIES})


def _under(kvstore: dict, name: str) -> dict:
  """The kvstore spec of the directory `name` under the directory of `kvstore`."""
  return dict(kvstore, path=f"{kvstore['path']}{name}/")


def _ocdbt(base: dict, writing: bool = False) -> dict:
  """The OCDBT database on the kvstore `base` (a directory, local or gs://); `writing` on gs://: data files of
  `REMOTE_DATA_FILE_BYTES`."""
  spec = {"driver": "ocdbt", "base": base}
  if writing and base.get("driver") == "gcs":
    spec["target_data_file_size"] = REMOTE_DATA_FILE_BYTES
  return spec


class OrbaxArrayWriter:
  """Creates the zarr3 arrays of one Orbax pytree in this process's OCDBT database and writes them by slices."""

  def __init__(self, items_dir: str, *, process_index: int = 0, context=None, digests=None):
    self.place = paths.place(items_dir)
    self.items_dir = self.place.path
    self.process_index = process_index
    self._context = context or ts_context()
    self._digests = digests  # `manifest.digests.Digests`: what it tracks is hashed as it is written
    self._names: dict[int, str] = {}  # id of a created array's handle -> its name (the key joined by dots)
    self._entries: dict[tuple[str, ...], tuple[int, ...]] = {}  # key -> chunk shape, every array of the pytree
    self._specs: dict[tuple[str, ...], tuple] = {}  # key -> (shape, dtype name, chunk), checked after the merge
    self._created: set[tuple[str, ...]] = set()  # the arrays this process writes
    self._scalars: set[tuple[str, ...]] = set()  # keys Orbax records as scalars (e.g. MaxText's `step`)
    self._in_flight: collections.deque = collections.deque()  # (futures, bytes held) of each write, oldest first
    self.written_bytes = 0

  def create(self, key: Sequence[str], shape: Sequence[int], dtype, chunk: Sequence[int]):
    """Opens a new zarr3 array at `key` (chunked by `chunk`); returns its tensorstore handle."""
    return self.create_many([(key, shape, dtype, chunk)])[0]

  def create_many(self, arrays: Sequence[tuple]) -> list:
    """`create` for every (key, shape, dtype, chunk[, metadata]) of `arrays`, opened concurrently (one commit of
    the database for them all, not one each); returns their tensorstore handles in order. `metadata` (a source
    array's zarr3 metadata) replaces the default one, for arrays whose stored chunks are copied as they are."""
    specs = []
    for key, shape, dtype, chunk, *stored in arrays:
      key = tuple(str(k) for k in key)
      if key in self._created:
        raise ValueError(f"array {'/'.join(key)} created twice")
      self._created.add(key)
      shape, chunk = [int(d) for d in shape], [max(1, int(c)) for c in chunk]
      self._entries[key] = tuple(chunk)
      self._specs[key] = (tuple(shape), np.dtype(dtype).name, tuple(chunk))
      kvstore = dict(_ocdbt(_under(self.place.kvstore, PROCESS_DIR.format(self.process_index)), writing=True),
                     path=".".join(key) + "/")
      metadata = {"shape": shape, "data_type": np.dtype(dtype).name,
                  "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": chunk}},
                  "codecs": [{"name": "bytes", "configuration": {"endian": "little"}},
                             {"name": "zstd", "configuration": {"level": ZSTD_LEVEL, "checksum": False}}],
                  "fill_value": 0}
      if stored and stored[0]:  # a verbatim copy of a source array: its metadata, codecs included
        metadata = {k: v for k, v in stored[0].items() if k not in ("attributes", "dimension_names")}
      specs.append({"driver": "zarr3", "kvstore": kvstore, "metadata": metadata,
                    "store_data_equal_to_fill_value": True})  # Orbax reads a missing chunk as an error
    try:
      futures = [ts.open(spec, create=True, open=True, context=self._context) for spec in specs]
      stores = [future.result() for future in futures]
    except Exception as e:  # pylint: disable=broad-except
      raise _write_error(self.items_dir, e) from None
    for store, spec in zip(stores, specs):
      self._names[id(store)] = spec["kvstore"]["path"][:-1]
    return stores

  def write_scalar(self, key: Sequence[str], value, dtype) -> None:
    """A scalar of the pytree (Orbax's `scalar` value type; MaxText's converter writes `step` so), written now."""
    store = self.create(key, (), dtype, ())
    self._scalars.add(tuple(str(k) for k in key))
    self.write_slice([(store, (), np.asarray(value, dtype))])

  def register(self, key: Sequence[str], chunk: Sequence[int], shape: Sequence[int] = (), dtype=None) -> None:
    """Records an array another process creates (for `_METADATA`, and checked after the merge)."""
    key = tuple(str(k) for k in key)
    self._entries.setdefault(key, tuple(int(c) for c in chunk))
    if dtype is not None:
      self._specs.setdefault(key, (tuple(int(d) for d in shape), np.dtype(dtype).name,
                                   tuple(max(1, int(c)) for c in chunk)))

  def write(self, store, index: tuple[slice, ...], value) -> None:
    """Writes `value` at `index` of `store` in the background (one write in flight at a time)."""
    self.write_slice([(store, index, value)])

  def write_slice(self, parts: Sequence[tuple], room: int = 0) -> None:
    """Writes every (store, index, value) of `parts` (one slice's outputs) in the background, together, once the
    earlier writes still in flight hold at most `room` bytes beside this one's (`in_flight_bytes`; 0: once they are
    all on disk)."""
    values = [np.ascontiguousarray(value) if np.ndim(value) else np.asarray(value) for _, _, value in parts]
    nbytes = sum(value.nbytes for value in values)  # (the former is >= 1-D)
    hashed = [(self._hashed(store), index, value) for (store, index, _), value in zip(parts, values)]
    hashed = [(name, index, value) for name, index, value in hashed if name is not None]
    self._start(IN_FLIGHT_FACTOR * nbytes + sum(value.nbytes for _, _, value in hashed), room,
                lambda: [store[index].write(value) if index else store.write(value)
                         for (store, index, _), value in zip(parts, values)]
                + [self._digests.add(name, index, value) for name, index, value in hashed])
    self.written_bytes += nbytes

  def write_stored(self, store, chunks: Sequence[tuple[str, bytes]], nbytes: int, room: int = 0) -> None:
    """Writes stored (encoded) chunks [(key, bytes)] of `store` as they are, in the background like
    `write_slice`; `nbytes`: their decoded size (decoded once more in the background, from these bytes, where the
    array is hashed)."""
    encoded, name = sum(len(value) for _, value in chunks), self._hashed(store)
    hashes = []
    if name is not None:
      index = _chunks_box(store, chunks)
      hashes = [lambda: self._digests.add(name, index, lambda: _decoded(store, chunks, index))]
    self._start(IN_FLIGHT_FACTOR * encoded + (nbytes if hashes else 0), room,
                lambda: [store.kvstore.write(key, value) for key, value in chunks] + [h() for h in hashes])
    self.written_bytes += nbytes

  def _hashed(self, store) -> str | None:
    """The name of `store` when its values are hashed as they are written (`digests`), else None."""
    name = self._names.get(id(store))
    return name if self._digests is not None and name is not None and self._digests.tracks(name) else None

  def _start(self, held: int, room: int, writes) -> None:
    """Makes room for a write that holds `held` bytes while in flight (`write_slice`), then starts it: `writes()`
    gives its futures."""
    self.make_room(room - held)
    budget.keep_within()
    try:
      futures = [future for future in writes() if future is not None]
    except Exception as e:  # pylint: disable=broad-except
      raise _write_error(self.items_dir, e) from None
    self._in_flight.append((futures, held))

  @property
  def in_flight_bytes(self) -> int:
    """What the writes in flight hold: `IN_FLIGHT_FACTOR` times the bytes given to each, and the bytes of each
    while it is hashed; and what the hashes keep of arrays written out of C order (`digests.held_bytes`)."""
    return sum(held for _, held in self._in_flight) + (self._digests.held_bytes if self._digests else 0)

  def make_room(self, room: int) -> None:
    """Waits for the oldest writes in flight until the rest hold at most `room` bytes (`in_flight_bytes`)."""
    while self._in_flight and self.in_flight_bytes > room:
      self._wait_oldest()

  def _wait_oldest(self) -> None:
    futures, _ = self._in_flight.popleft()
    failure = None
    for future in futures:
      try:
        future.result()
      except Exception as e:  # pylint: disable=broad-except
        failure = failure or e
    if failure is not None:
      self.abandon()
      raise _write_error(self.items_dir, failure) from None

  def wait(self) -> None:
    """Blocks until the background writes (if any) are on disk."""
    while self._in_flight:
      self._wait_oldest()

  def abandon(self) -> None:
    """Waits for the background writes, ignoring their outcome (the work is being abandoned)."""
    in_flight, self._in_flight = self._in_flight, collections.deque()
    for futures, _ in in_flight:
      for future in futures:
        try:
          future.result()
        except Exception:  # pylint: disable=broad-except
          pass

  def finalize(self, step_dir: str, item: str, process_count: int = 1, *, complete: bool = True) -> None:
    """Checks that every process's database is there, merges them into the root one, checks every array and
    chunk of the result (`verify`) and writes `_METADATA` and `_CHECKPOINT_METADATA`.

    Called by process 0 once every process has finished writing. `complete=False` allows chunks never written
    (tests that build a sparse source).

    Raises:
      errors.CheckpointError: a database, an array's metadata or one of its chunks is missing or wrong.
    """

    self.wait()
    verify.check_databases(self.place.kvstore, self.items_dir, PROCESS_DIR, process_count, self._context)
    try:
      self._merge(process_count)
      merged = ts.KvStore.open(_ocdbt(self.place.read_kvstore), context=self._context).result()
    except Exception as e:  # pylint: disable=broad-except
      raise _write_error(self.items_dir, e) from None
    verify.check_merged(merged, self._specs, self._context, complete=complete)
    try:
      self._write_json(f"{self.items_dir}/_METADATA", tree_metadata(self._entries, self._scalars))
      arrays = {key: chunk for key, chunk in self._entries.items() if key not in self._scalars}
      self._write_json(f"{self.items_dir}/_sharding", _default_shardings(arrays))
      now = time.time_ns()
      self._write_json(f"{step_dir}/_CHECKPOINT_METADATA",
                       {"item_handlers": {item: compat.ORBAX_PYTREE_HANDLER}, "metrics": {}, "performance_metrics": {},
                        "init_timestamp_nsecs": now, "commit_timestamp_nsecs": now, "custom_metadata": {}})
    except Exception as e:  # pylint: disable=broad-except
      raise _write_error(self.items_dir, e) from None

  def _write_json(self, path: str, doc: dict) -> None:
    """`doc` as the file `path`: on gs:// one object written whole, locally a temporary file renamed into place."""
    data = json.dumps(doc)
    if self.place.remote:
      objects.write(path, data.encode())
      return
    with open(path + ".tmp", "w", encoding="utf-8") as f:
      f.write(data)
    os.replace(path + ".tmp", path)

  def _merge(self, process_count: int) -> None:
    """Copies every process's OCDBT database into the root database of the pytree (as Orbax does): the root's
    B-tree refers to the processes' data files, which stay where they are."""
    parent = ts.KvStore.open(_ocdbt(self.place.kvstore), context=self._context).result()
    txn = ts.Transaction(atomic=True)
    for index in range(process_count):
      store = ts.KvStore.open(_ocdbt(_under(self.place.kvstore, PROCESS_DIR.format(index))),
                              context=self._context).result()
      store.experimental_copy_range_to(parent.with_transaction(txn)).result()
    txn.commit_async().result()


def _chunks_box(store, chunks: Sequence[tuple[str, bytes]]) -> tuple[slice, ...]:
  """The box of `store` that its stored chunks [(key "c/i/j", bytes)] cover (regular grid, default keys)."""
  chunk = store.spec().to_json()["metadata"]["chunk_grid"]["configuration"]["chunk_shape"]
  grid = [[int(i) for i in key.split("/")[1:]] for key, _ in chunks]
  return tuple(slice(min(g[a] for g in grid) * c, min(d, (max(g[a] for g in grid) + 1) * c))
               for a, (c, d) in enumerate(zip(chunk, store.shape)))


def _decoded(store, chunks: Sequence[tuple[str, bytes]], index: tuple[slice, ...]) -> np.ndarray:
  """The values of the stored chunks of `store` that cover `index`, decoded from their bytes in memory (an array
  of `store`'s metadata on tensorstore's memory kvstore, in a context of its own)."""
  spec = store.spec().to_json()
  twin = ts.open({"driver": "zarr3", "kvstore": {"driver": "memory", "path": "twin/"}, "metadata": spec["metadata"]},
                 create=True, context=ts.Context()).result()
  for future in [twin.kvstore.write(key, value) for key, value in chunks]:
    future.result()
  return twin[index].read().result()


def tree_metadata(entries: dict[tuple[str, ...], tuple[int, ...]], scalars=frozenset()) -> dict:
  """Orbax's `_METADATA` for a pytree of nested dicts of arrays (keys → write/chunk shape) and `scalars`."""
  nodes = {}
  for key, chunk in sorted(entries.items()):
    value = ({"value_type": "scalar", "skip_deserialize": False} if key in scalars else
             {"value_type": "jax.Array", "skip_deserialize": False, "write_shape": list(chunk)})
    nodes[str(key)] = {"key_metadata": [{"key": k, "key_type": 2} for k in key], "value_metadata": value}
  return {"tree_metadata": nodes, "use_ocdbt": True, "use_zarr3": True,
          "store_array_data_equal_to_fill_value": True, "custom_metadata": None}


def _write_error(path: str, e: BaseException):
  return ptq_weights.write_error(path, e)


def _default_shardings(entries) -> dict:
  """Orbax's `_sharding` file: each array restores onto this process's first device unless told otherwise."""
  device = json.dumps({"sharding_type": "SingleDeviceSharding", "device_str": str(jax.local_devices()[0])})
  return {base64.urlsafe_b64encode(".".join(key).encode()).decode(): device for key in sorted(entries)}


def remove_share(tmp: str, items_dir: str, index: int) -> None:
  """Process `index` (not 0) of a failed job: removes its database, and the directories up to `tmp` once empty
  (process 0 removes `tmp`; writing after that recreates the path without the marker that lets a later run
  reclaim it). On gs:// its database's objects (what is left of the staging prefix, the next run removes)."""
  share = paths.join(items_dir, PROCESS_DIR.format(index))
  if paths.is_remote(share):
    with contextlib.suppress(Exception):
      objects.delete_all(share)
    return
  shutil.rmtree(share, ignore_errors=True)
  for directory in (items_dir, os.path.dirname(items_dir), tmp):
    try:
      os.rmdir(directory)
    except OSError:
      break

