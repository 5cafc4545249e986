"""Export stages 3 and 4, quantize and write: every array into an Orbax checkpoint, slice by slice.

Layout (Orbax, OCDBT + zarr3, the MaxText converter layout): `DST/0/items/params/params/<module path>/<name>`
for copied arrays, `.../<name>/array/qvalue` (float8_e4m3fn, the weight's shape) and `.../<name>/array/scale`
(the weight's rank, 1 on shared axes) for quantized ones — Qwix PTQ's layout, used for experts too. Scanned
stacks stay scanned (layer axis at `param_scan_axis`), so e.g. the experts `MoeBlock_0/wi_0` (X, L, E, F) get
a scale of shape (1, L, 1, F) and a dense `wq_b/kernel` (R, L, H, D) one of (1, L, H, D). Scales are stored in
the dtype the forward pass quantizes in (the compute dtype, bfloat16 by default): exactly Qwix PTQ's scales, and
exactly (in value) the float32 scales of the FP8 grouped matmul. Everything, the gate bias included, is written
under `params/params` (MaxText's params-only loaders find the bias there too).

Writing: each array is cut into slices that fit the memory budget (`budget`); a slice is read from the source,
quantized (`quant.ptq_weights.quantize_weight`: a slice along channel axes gets exactly the whole weight's
scales) and written into the destination zarr3 array, chunked by the slice block, through tensorstore. As Orbax
does, each process writes into its own OCDBT database (`items/ocdbt.process_<i>/`), and process 0 merges them
into the checkpoint's root database and writes `_METADATA` (the pytree: Orbax's format, `use_ocdbt`, `use_zarr3`)
and the step's `_CHECKPOINT_METADATA`. With several processes (`jax.distributed`), process `i` handles every
slice whose running number is `i` modulo the process count. A copied array whose slices are whole chunks of a
zarr3 source keeps the source's metadata and chunks: their stored bytes are copied, not decoded and encoded again.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import time
from typing import Any, Callable, Sequence

import numpy as np

from inspect_tool import atomic
from inspect_tool import tree
from inspect_tool.fp8_export import budget as budget_lib

ZSTD_LEVEL = 3  # Orbax's
PROCESS_DIR = "ocdbt.process_{}"


def ts_context():
  """A tensorstore context without a chunk cache (every byte read is used once) and bounded copy threads."""
  import tensorstore as ts  # pylint: disable=import-outside-toplevel

  return ts.Context({"cache_pool": {"total_bytes_limit": 0}, "data_copy_concurrency": {"limit": min(os.cpu_count() or 1, 4)},
                     "file_io_concurrency": {"limit": 16}})


def _ocdbt(path: str) -> dict:
  return {"driver": "ocdbt", "base": {"driver": "file", "path": os.path.abspath(path) + "/"}}


@dataclasses.dataclass(frozen=True)
class Written:
  """What `write_arrays` wrote: the copied leaves and the bytes read and written (by this process)."""

  copied: list
  source_bytes: int
  written_bytes: int


class OrbaxArrayWriter:
  """Creates the zarr3 arrays of one Orbax pytree in this process's OCDBT database and writes them by slices."""

  def __init__(self, items_dir: str, *, process_index: int = 0, context=None):
    self.items_dir = os.path.abspath(items_dir)
    self.process_index = process_index
    self._context = context or ts_context()
    self._entries: dict[tuple[str, ...], tuple[int, ...]] = {}  # key -> chunk shape, every array of the pytree
    self._created: set[tuple[str, ...]] = set()  # the arrays this process writes
    self._in_flight: list = []  # the background writes of the last slice
    self.written_bytes = 0

  def create(self, key: Sequence[str], shape: Sequence[int], dtype, chunk: Sequence[int]):
    """Opens a new zarr3 array at `key` (chunked by `chunk`); returns its tensorstore handle."""
    return self.create_many([(key, shape, dtype, chunk)])[0]

  def create_many(self, arrays: Sequence[tuple]) -> list:
    """`create` for every (key, shape, dtype, chunk[, metadata]) of `arrays`, opened concurrently (one commit of
    the database for them all, not one each); returns their tensorstore handles in order. `metadata` (a source
    array's zarr3 metadata) replaces the default one, for arrays whose stored chunks are copied as they are."""
    import tensorstore as ts  # pylint: disable=import-outside-toplevel

    specs = []
    for key, shape, dtype, chunk, *stored in arrays:
      key = tuple(str(k) for k in key)
      if key in self._created:
        raise ValueError(f"array {'/'.join(key)} created twice")
      self._created.add(key)
      shape, chunk = [int(d) for d in shape], [max(1, int(c)) for c in chunk]
      self._entries[key] = tuple(chunk)
      kvstore = dict(_ocdbt(os.path.join(self.items_dir, PROCESS_DIR.format(self.process_index))),
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
      return [future.result() for future in futures]
    except Exception as e:  # pylint: disable=broad-except
      raise _write_error(self.items_dir, e) from None

  def register(self, key: Sequence[str], chunk: Sequence[int]) -> None:
    """Records an array another process creates (for `_METADATA`)."""
    self._entries.setdefault(tuple(str(k) for k in key), tuple(int(c) for c in chunk))

  def write(self, store, index: tuple[slice, ...], value) -> None:
    """Writes `value` at `index` of `store` in the background (one write in flight at a time)."""
    self.write_slice([(store, index, value)])

  def write_slice(self, parts: Sequence[tuple]) -> None:
    """Writes every (store, index, value) of `parts` (one slice's outputs) in the background, together, once
    the previous slice's writes are on disk."""
    self.wait()
    try:
      for store, index, value in parts:
        value = np.ascontiguousarray(value)
        self._in_flight.append(store[index].write(value) if index else store.write(value))
        self.written_bytes += value.nbytes
    except Exception as e:  # pylint: disable=broad-except
      raise _write_error(self.items_dir, e) from None

  def write_stored(self, store, chunks: Sequence[tuple[str, bytes]], nbytes: int) -> None:
    """Writes stored (encoded) chunks [(key, bytes)] of `store` as they are, in the background like
    `write_slice`; `nbytes`: their decoded size."""
    self.wait()
    try:
      kvstore = store.kvstore
      self._in_flight.extend(kvstore.write(key, value) for key, value in chunks)
    except Exception as e:  # pylint: disable=broad-except
      raise _write_error(self.items_dir, e) from None
    self.written_bytes += nbytes

  def wait(self) -> None:
    """Blocks until the background writes (if any) are on disk."""
    in_flight, self._in_flight = self._in_flight, []
    failure = None
    for future in in_flight:
      try:
        future.result()
      except Exception as e:  # pylint: disable=broad-except
        failure = failure or e
    if failure is not None:
      raise _write_error(self.items_dir, failure) from None

  def abandon(self) -> None:
    """Waits for the background write, ignoring its outcome (the work is being abandoned)."""
    try:
      self.wait()
    except Exception:  # pylint: disable=broad-except
      pass

  def finalize(self, step_dir: str, item: str) -> None:
    """Merges every process's database into the root one and writes `_METADATA` and `_CHECKPOINT_METADATA`.

    Called by process 0 once every process has finished writing.
    """
    from quant import compat  # pylint: disable=import-outside-toplevel

    self.wait()
    try:
      self._merge()
      _write_json(os.path.join(self.items_dir, "_METADATA"), tree_metadata(self._entries))
      _write_json(os.path.join(self.items_dir, "_sharding"), _default_shardings(self._entries))
      now = time.time_ns()
      _write_json(os.path.join(step_dir, "_CHECKPOINT_METADATA"),
                  {"item_handlers": {item: compat.ORBAX_PYTREE_HANDLER}, "metrics": {}, "performance_metrics": {},
                   "init_timestamp_nsecs": now, "commit_timestamp_nsecs": now, "custom_metadata": {}})
    except Exception as e:  # pylint: disable=broad-except
      raise _write_error(self.items_dir, e) from None

  def _merge(self) -> None:
    """Copies every process's OCDBT database into the root database of the pytree (as Orbax does)."""
    import tensorstore as ts  # pylint: disable=import-outside-toplevel

    children = sorted(d for d in os.listdir(self.items_dir) if d.startswith(PROCESS_DIR.format("")))
    parent = ts.KvStore.open(_ocdbt(self.items_dir), context=self._context).result()
    txn = ts.Transaction(atomic=True)
    for child in children:
      store = ts.KvStore.open(_ocdbt(os.path.join(self.items_dir, child)), context=self._context).result()
      store.experimental_copy_range_to(parent.with_transaction(txn)).result()
    txn.commit_async().result()


def tree_metadata(entries: dict[tuple[str, ...], tuple[int, ...]]) -> dict:
  """Orbax's `_METADATA` for a pytree of nested dicts of arrays (keys → write/chunk shape)."""
  nodes = {}
  for key, chunk in sorted(entries.items()):
    nodes[str(key)] = {"key_metadata": [{"key": k, "key_type": 2} for k in key],
                       "value_metadata": {"value_type": "jax.Array", "skip_deserialize": False,
                                          "write_shape": list(chunk)}}
  return {"tree_metadata": nodes, "use_ocdbt": True, "use_zarr3": True,
          "store_array_data_equal_to_fill_value": True, "custom_metadata": None}


def _write_error(path: str, e: BaseException):
  from quant import ptq_weights  # pylint: disable=import-outside-toplevel

  return ptq_weights.write_error(path, e)


def _default_shardings(entries) -> dict:
  """Orbax's `_sharding` file: each array restores onto this process's first device unless told otherwise."""
  import base64  # pylint: disable=import-outside-toplevel
  import jax  # pylint: disable=import-outside-toplevel

  device = json.dumps({"sharding_type": "SingleDeviceSharding", "device_str": str(jax.local_devices()[0])})
  return {base64.urlsafe_b64encode(".".join(key).encode()).decode(): device for key in sorted(entries)}


def _write_json(path: str, doc: dict) -> None:
  tmp = path + ".tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    json.dump(doc, f)
  os.replace(tmp, path)


@dataclasses.dataclass(frozen=True)
class ArrayJob:
  """One source array: where it goes, how it is quantized (None: copied) and how it is cut."""

  leaf: tree.Leaf  # the model leaf key with the source's shape and stored dtype
  out_key: tuple[str, ...]
  quant: Any  # quant.ptq_weights.WeightQuant or None
  slicing: budget_lib.Slicing
  chunk: tuple[int, ...] = ()  # destination chunk: divides the slice block (tensorstore encodes chunks in parallel)
  stored: dict | None = None  # a copy whose slices are whole source chunks: their stored bytes are copied as is

  @property
  def slice_bytes(self) -> int:
    return int(np.prod(self.slicing.block, dtype=np.int64)) * np.dtype(self.leaf.dtype).itemsize


CHUNK_BYTES = 32 * 2**20  # at most this much per destination chunk
DECODING_CHUNKS = 2  # source chunks tensorstore may hold decoded at once (its copy threads)
RESERVE_BYTES = 160 * 2**20  # compiling and compiled quantizers, tensorstore's buffers, beside the slices


def plan_jobs(plan, source, max_memory: int, held: int | None = None) -> list[ArrayJob]:
  """Cuts every source array into slices so that the process stays under `max_memory` bytes.

  What is left after the memory the process already holds (`held`, default: its resident memory now: Python, JAX,
  the plan; plus `RESERVE_BYTES`) must hold `DECODING_CHUNKS` decoded source chunks and `budget.SLICE_FACTOR`
  times a slice. A slice that cuts across the source's chunks decodes each of them again: a source chunked along
  an axis the scales are reduced over (experts, rows) is read several times when the budget is tight.

  Raises:
    errors.InputError: `max_memory` is smaller than what the smallest slice of some array needs.
  """
  from inspect_tool import errors  # pylint: disable=import-outside-toplevel

  held = (budget_lib.current_rss() if held is None else held) + RESERVE_BYTES
  jobs = []
  for key in source.keys():
    leaf = source.leaf(key)
    wq = plan.weights.get(key)
    itemsize = np.dtype(leaf.dtype).itemsize
    cuttable = tuple(wq.channel_axes) if wq is not None else tuple(range(len(leaf.shape)))
    store = source.open(key)
    chunk = source.chunk_bytes(store) * DECODING_CHUNKS
    slice_budget = (max_memory - held - chunk) // budget_lib.SLICE_FACTOR
    cut = (budget_lib.slicing(leaf.shape, itemsize, slice_budget, cuttable, source.chunk_shape(store))
           if slice_budget > 0 else None)
    if cut is None:
      need = held + chunk + budget_lib.smallest_slice(leaf.shape, itemsize, cuttable) * budget_lib.SLICE_FACTOR
      raise errors.InputError(
          f"--max-memory {budget_lib.format_size(max_memory)} is smaller than the smallest slice of "
          f"{'/'.join(key)} {tuple(leaf.shape)} needs (with the {budget_lib.format_size(held)} the process holds"
          f"{' and decoded source chunks of ' + budget_lib.format_size(chunk) if chunk else ''}); accepted: at least "
          f"{budget_lib.format_size(need)}")
    out_key = tree.param_key(leaf.module_path)  # converter layout: everything under params/params
    chunk = budget_lib.chunk_within(cut.block, itemsize, CHUNK_BYTES, cuttable)
    stored = _stored_copy(source, store, cut) if wq is None else None
    if stored is not None:
      chunk = tuple(stored["chunk_grid"]["configuration"]["chunk_shape"])
    jobs.append(ArrayJob(tree.Leaf(key, tuple(leaf.shape), leaf.dtype), out_key, wq, cut, chunk, stored))
  return jobs


def _stored_copy(source, store, cut: budget_lib.Slicing) -> dict | None:
  """The source array's metadata when the slices of `cut` are whole stored chunks of it (copied as they are)."""
  stored = source.stored_layout(store)
  if stored is None:
    return None
  chunk = stored["chunk_grid"]["configuration"]["chunk_shape"]
  if len(chunk) != len(cut.shape) or any(b % c and b < d for b, c, d in zip(cut.block, chunk, cut.shape)):
    return None
  return stored


def _chunk_keys(index: tuple[slice, ...], chunk: Sequence[int]) -> list[str]:
  """The zarr3 keys (default encoding) of the chunks that the block `index` covers."""
  ranges = [range(s.start // c, -(-s.stop // c)) for s, c in zip(index, chunk)]
  return ["c" + "".join(f"/{i}" for i in grid) for grid in itertools.product(*ranges)]


def _scale_index(index: tuple[slice, ...], wq) -> tuple[slice, ...]:
  """The part of the scale array that the weight slice `index` determines."""
  return tuple(s if axis in wq.channel_axes else slice(0, 1) for axis, s in enumerate(index))


def _scale_chunk(block: tuple[int, ...], wq) -> tuple[int, ...]:
  return tuple(b if axis in wq.channel_axes else 1 for axis, b in enumerate(block))


def _outputs(job: ArrayJob) -> list[tuple]:
  """(key, shape, dtype, chunk[, metadata]) of the destination arrays of `job`: the copy (with the source's
  metadata when its stored chunks are copied), or the qvalue and the scale."""
  wq, leaf, block = job.quant, job.leaf, job.chunk or job.slicing.block
  if wq is None:
    return [(job.out_key, leaf.shape, leaf.dtype, block, job.stored)]
  return [(wq.qvalue_key, leaf.shape, wq.qtype, block),
          (wq.scale_key, wq.scale_shape, wq.compute_dtype, _scale_chunk(block, wq))]


class _Reads:
  """The slices to read, in order, each started in the background when the one before it is taken."""

  def __init__(self, source, work: list[tuple[ArrayJob, tuple[slice, ...]]]):
    self._source, self._work, self._next = source, work, 0
    self._key = self._store = None  # the source array being read
    self._pending = self._start(0)

  def _start(self, i: int):
    if i >= len(self._work):
      return None
    job, index = self._work[i]
    if job.leaf.key != self._key:
      self._key, self._store = job.leaf.key, self._source.open(job.leaf.key)
    if job.stored is not None:
      return self._source.read_stored_async(self._store, _chunk_keys(index, job.chunk))
    return self._source.read_async(self._store, index)

  def read_again(self, index: tuple[slice, ...]):
    """The decoded values of a slice of the array being read (a slice whose chunks are not all stored)."""
    return self._source.read(self._store, index)

  def take(self):
    """The next slice's values; starts reading the one after it."""
    pending, self._next = self._pending, self._next + 1
    self._pending = None
    value = pending.result()
    self._pending = self._start(self._next)
    return value

  def close(self) -> None:
    """Waits for the read in flight, ignoring its outcome."""
    pending, self._pending = self._pending, None
    try:
      if pending is not None:
        pending.result()
    except Exception:  # pylint: disable=broad-except
      pass


def write_arrays(jobs: Sequence[ArrayJob], source, items_dir: str, *, process_index: int = 0,
                 process_count: int = 1, on_slice: Callable[[int, int], None] | None = None):
  """Reads, quantizes and writes every slice of `jobs` that this process owns into `items_dir`'s arrays.

  Three stages overlap: slice k+1 is read (tensorstore threads) while slice k is quantized, and slice k-1's
  outputs are encoded and written meanwhile; so memory holds about three slices at once (`budget.SLICE_FACTOR`).
  `on_slice(source_bytes, arrays_done)` is called after each slice and array (progress). The checkpoint is
  complete once every process has returned and process 0 has called `finalize` on the returned writer.

  Returns:
    (OrbaxArrayWriter, Written).

  Raises:
    quant.errors.QuantError: a write failed (e.g. disk full) or a weight cannot be quantized.
    errors.CheckpointError: the source cannot be read.
  """
  from inspect_tool.fp8_export import read as read_lib  # pylint: disable=import-outside-toplevel
  from quant import ptq_weights  # pylint: disable=import-outside-toplevel

  writer = OrbaxArrayWriter(items_dir, process_index=process_index)
  copied, source_bytes, running, owned = [], 0, 0, []
  for job in jobs:
    if job.quant is None:
      copied.append(tree.Leaf(job.out_key, job.leaf.shape, job.leaf.dtype))
    for key, _, _, chunk, *_ in _outputs(job):
      writer.register(key, chunk)
    owned.append([index for i, index in enumerate(job.slicing.slices())
                  if (running + i) % process_count == process_index])
    running += job.slicing.count
  reads = None
  try:
    mine = [job for job, indices in zip(jobs, owned) if indices]
    stores = iter(writer.create_many([spec for job in mine for spec in _outputs(job)]))
    outputs = {id(job): [next(stores) for _ in _outputs(job)] for job in mine}
    reads = _Reads(source, [(job, index) for job, indices in zip(jobs, owned) for index in indices])
    for number, (job, indices) in enumerate(zip(jobs, owned)):
      wq = job.quant
      for index in indices:
        value = reads.take()
        if job.stored is not None:
          nbytes = math.prod(s.stop - s.start for s in index) * np.dtype(job.leaf.dtype).itemsize
          if value is not None:  # every chunk stored: copied as it is
            writer.write_stored(outputs[id(job)][0], value, nbytes)
          else:
            writer.write_slice([(outputs[id(job)][0], index, reads.read_again(index))])
          source_bytes += nbytes
          if on_slice is not None:
            on_slice(nbytes, 0)
          continue
        nbytes = value.nbytes
        source_bytes += nbytes
        if wq is None:
          writer.write_slice([(outputs[id(job)][0], index, value)])
        else:
          value = read_lib.to_jax(value)  # the slice itself when aligned, else a copy (the numpy one freed)
          qvalue, scale = ptq_weights.quantize_weight(  # one jitted call: the slice is already within budget
              value, dataclasses.replace(wq, shape=tuple(value.shape)), chunk_bytes=1 << 62)
          del value
          out, out_scale = outputs[id(job)]
          writer.write_slice([(out, index, np.asarray(qvalue)), (out_scale, _scale_index(index, wq), np.asarray(scale))])
          del qvalue, scale
        if on_slice is not None:
          on_slice(nbytes, 0)
      if on_slice is not None:
        on_slice(0, 1)
      if number == len(jobs) // 2:
        atomic.test_point("arrays", before=writer.wait)
    writer.wait()
  except BaseException:
    if reads is not None:
      reads.close()
    writer.abandon()  # no background write may outlive the temporary directory
    raise
  return writer, Written(copied, source_bytes, writer.written_bytes)
