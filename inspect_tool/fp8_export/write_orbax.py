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
quantized (`quantize`'s compiled quantizers: a slice along channel axes gets exactly the whole weight's scales; the
blocks of a two-pass weight get its absmax from a first pass) and written into the destination zarr3 array,
chunked by the slice block, through tensorstore. As Orbax does, each process writes into its own OCDBT database
(`items/ocdbt.process_<i>/`), and process 0 merges them into the checkpoint's root database and writes `_METADATA`
(the pytree: Orbax's format, `use_ocdbt`, `use_zarr3`) and the step's `_CHECKPOINT_METADATA`. With several
processes (`jax.distributed`), process `i` handles every unit of work (a slice; a two-pass group of blocks) whose
running number is `i` modulo the process count. A copied array from a zarr3 source is cut in whole chunks and
keeps the source's metadata and chunks: their stored bytes are copied, not decoded and encoded again.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any, Callable, Sequence

import numpy as np

from inspect_tool.output import atomic
from inspect_tool.paramtree import tree
from inspect_tool.fp8_export import budget as budget_lib
from inspect_tool.fp8_export import orbax_writer

@dataclasses.dataclass(frozen=True)
class Written:
  """What `write_arrays` wrote: the copied leaves and the bytes read and written (by this process)."""

  copied: list
  source_bytes: int
  written_bytes: int


@dataclasses.dataclass(frozen=True)
class ArrayJob:
  """One source array: where it goes, how it is quantized (None: copied) and how it is cut."""

  leaf: tree.Leaf  # the model leaf key with the source's shape and stored dtype
  out_key: tuple[str, ...]
  quant: Any  # quant.ptq_weights.WeightQuant or None
  slicing: budget_lib.Slicing
  chunk: tuple[int, ...] = ()  # destination chunk: divides the slice block (tensorstore encodes chunks in parallel)
  stored: dict | None = None  # a copy whose slices are whole source chunks: their stored bytes are copied as is
  two_pass: bool = False  # quantized in two passes over blocks that also cut the shared axes

  @property
  def slice_bytes(self) -> int:
    return int(np.prod(self.slicing.block, dtype=np.int64)) * np.dtype(self.leaf.dtype).itemsize

  def units(self) -> list[list[tuple[slice, ...]]]:
    """The units of work, in order: one slice each; for a two-pass job, the slices that share channels (their
    absmax is gathered over all of them before any is quantized)."""
    if not self.two_pass:
      return [[index] for index in self.slicing.slices()]
    groups: dict[tuple, list] = {}
    for index in self.slicing.slices():
      channels = tuple((s.start, s.stop) for axis, s in enumerate(index) if axis in self.quant.channel_axes)
      groups.setdefault(channels, []).append(index)
    return list(groups.values())


CHUNK_BYTES = 32 * 2**20  # at most this much per destination chunk
DECODING_CHUNKS = 2  # source chunks tensorstore may hold decoded at once (its copy threads)
# Compiling and compiled quantizers, tensorstore's buffers, beside the slices. Measured: `--max-memory 600MB` on the
# benchmark's embedding source holds 0.26 GB when slicing starts and peaks at 0.39 GB (bench/bench_export.py).
RESERVE_BYTES = 96 * 2**20


def plan_jobs(plan, source, max_memory: int, held: int | None = None) -> list[ArrayJob]:
  """Cuts every source array into slices so that the process stays under `max_memory` bytes.

  What is left after the memory the process already holds (`held`, default: its resident memory now: Python, JAX,
  the plan; plus `RESERVE_BYTES`) must hold `DECODING_CHUNKS` decoded source chunks and `budget.SLICE_FACTOR`
  times a slice. A slice that cuts across the source's chunks decodes each of them again: a source chunked along
  an axis the scales are reduced over (experts, rows) would be read once per slice when the budget is tight. Such
  a weight with absmax scales is quantized in two passes instead (`ArrayJob.two_pass`) over blocks cut along the
  source's chunks on every axis: the first gathers the absmax of the blocks that share channels, the second
  quantizes them; each chunk is decoded twice when a slice may hold one. It is chosen when it decodes less
  (`budget.decode_factor`).

  Raises:
    errors.InputError: `max_memory` is smaller than what the smallest slice of some array needs.
  """
  from inspect_tool import errors  # pylint: disable=import-outside-toplevel
  from quant import ptq_weights  # pylint: disable=import-outside-toplevel

  held = (budget_lib.current_rss() if held is None else held) + RESERVE_BYTES
  jobs, short = [], []
  for key in source.keys():
    leaf = source.leaf(key)
    wq = plan.weights.get(key)
    itemsize = np.dtype(leaf.dtype).itemsize
    every_axis = tuple(range(len(leaf.shape)))
    gathers = wq is not None and ptq_weights.gathers_absmax(wq)  # may be cut along every axis, in two passes
    cuttable = tuple(wq.channel_axes) if wq is not None else every_axis
    store = source.open(key)
    chunk = source.chunk_bytes(store) * DECODING_CHUNKS
    align = source.chunk_shape(store)
    slice_budget = (max_memory - held - chunk) // budget_lib.SLICE_FACTOR
    cut = wide = None
    if slice_budget > 0:
      cut = budget_lib.slicing(leaf.shape, itemsize, slice_budget, cuttable, align)
      wide = budget_lib.slicing(leaf.shape, itemsize, slice_budget, every_axis, align) if gathers else None
    once = math.inf if cut is None else budget_lib.decode_factor(leaf.shape, cut.block, align)
    two_pass = wide is not None and 2 * budget_lib.decode_factor(leaf.shape, wide.block, align) < once
    if two_pass:
      cut, cuttable = wide, every_axis
    if cut is None:
      smallest = budget_lib.smallest_slice(leaf.shape, itemsize, every_axis if gathers else cuttable)
      short.append((held + chunk + smallest * budget_lib.SLICE_FACTOR, key, tuple(leaf.shape), chunk))
      continue
    out_key = tree.param_key(leaf.module_path)  # converter layout: everything under params/params
    stored = None
    if wq is None:
      stored, cut = _stored_copy(source, store, cut)
    chunk = budget_lib.chunk_within(cut.block, itemsize, CHUNK_BYTES, cuttable)
    if stored is not None:
      chunk = tuple(stored["chunk_grid"]["configuration"]["chunk_shape"])
    jobs.append(ArrayJob(tree.Leaf(key, tuple(leaf.shape), leaf.dtype), out_key, wq, cut, chunk, stored, two_pass))
  if short:  # name the array that needs the most: its need is the smallest budget that works for every array
    need, key, shape, chunk = max(short, key=lambda item: item[0])
    raise errors.InputError(
        f"--max-memory {budget_lib.format_size(max_memory)} is smaller than the smallest slice of "
        f"{'/'.join(key)} {shape} needs (with the {budget_lib.format_size(held)} the process holds"
        f"{' and decoded source chunks of ' + budget_lib.format_size(chunk) if chunk else ''}); accepted: at least "
        f"{budget_lib.format_size(need)}")
  return sorted(jobs, key=lambda job: job.quant is not None)  # copies first: the quantizers compile meanwhile


def _stored_copy(source, store, cut: budget_lib.Slicing) -> tuple[dict | None, budget_lib.Slicing]:
  """(The source array's metadata, `cut` in whole stored chunks) for an array whose stored chunks are copied as
  they are: each side of the block is rounded down to whole chunks, or up to one chunk (one chunk's stored bytes
  fit in what the budget keeps for decoded source chunks). (None, `cut`) when the chunks cannot be copied."""
  stored = source.stored_layout(store)
  if stored is None:
    return None, cut
  chunk = stored["chunk_grid"]["configuration"]["chunk_shape"]
  if len(chunk) != len(cut.shape):
    return None, cut
  block = tuple(d if b >= d else min(d, max(c, b // c * c)) for b, c, d in zip(cut.block, chunk, cut.shape))
  return stored, budget_lib.Slicing(cut.shape, block)


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


class _Ready:
  """A read that needs no reading: the slice is still in memory."""

  def result(self):
    return None


class _Reads:
  """The slices to read, in order, each started in the background when the one before it is taken.

  `work` holds (job, index, kind) items; a `REUSE` item reads nothing (its value is the last one taken).
  """

  def __init__(self, source, work: list[tuple[ArrayJob, tuple[slice, ...], str]]):
    self._source, self._work, self._next = source, work, 0
    self._key = self._store = None  # the source array being read
    self._pending = self._start(0)

  def _start(self, i: int):
    if i >= len(self._work):
      return None
    job, index, kind = self._work[i]
    if kind == REUSE:
      return _Ready()
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


SLICE, ABSMAX, REUSE = "slice", "absmax", "reuse"  # read and write; read for pass 1; pass 2 of the last one read


def _work(job: ArrayJob, unit: list[tuple[slice, ...]]) -> list[tuple[ArrayJob, tuple[slice, ...], str]]:
  """The reads of one unit of `job`: its slice; or, two-pass, every block for the absmax, then every block again
  in reverse order for quantizing, the first of them (the last read) kept from pass 1."""
  if not job.two_pass:
    return [(job, index, SLICE) for index in unit]
  return ([(job, index, ABSMAX) for index in unit]
          + [(job, index, REUSE if i == 0 else SLICE) for i, index in enumerate(reversed(unit))])


def write_arrays(jobs: Sequence[ArrayJob], source, items_dir: str, *, process_index: int = 0,
                 process_count: int = 1, on_slice: Callable[[int, int], None] | None = None):
  """Reads, quantizes and writes every unit of work of `jobs` that this process owns into `items_dir`'s arrays.

  Three stages overlap: slice k+1 is read (tensorstore threads) while slice k is quantized, and slice k-1's
  outputs are encoded and written meanwhile; so memory holds about three slices at once (`budget.SLICE_FACTOR`).
  A two-pass job (`ArrayJob.two_pass`) reads each group of blocks that share channels twice: their absmax first,
  then the blocks again to quantize them; the group's scale is written with its first quantized block.
  `on_slice(source_bytes, arrays_done)` is called after each slice (half the bytes per pass of a two-pass job) and
  array (progress). The checkpoint is complete once every process has returned and process 0 has called
  `finalize` on the returned writer. With several processes, process `i` owns every unit whose running number is
  `i` modulo the process count.

  Returns:
    (`orbax_writer.OrbaxArrayWriter`, Written).

  Raises:
    quant.errors.QuantError: a write failed (e.g. disk full) or a weight cannot be quantized.
    errors.CheckpointError: the source cannot be read.
  """
  writer = orbax_writer.OrbaxArrayWriter(items_dir, process_index=process_index)
  copied, running, owned = [], 0, []
  for job in jobs:
    if job.quant is None:
      copied.append(tree.Leaf(job.out_key, job.leaf.shape, job.leaf.dtype))
    for key, shape, dtype, chunk, *_ in _outputs(job):
      writer.register(key, chunk, shape, dtype)
    units = job.units()
    owned.append([unit for i, unit in enumerate(units) if (running + i) % process_count == process_index])
    running += len(units)
  from inspect_tool.fp8_export import quantize  # pylint: disable=import-outside-toplevel

  reads = None
  progress = on_slice or (lambda nbytes, arrays: None)
  mine = [job for job, units in zip(jobs, owned) if units]
  quantizers = quantize.Quantizers(mine)
  try:
    stores = iter(writer.create_many([spec for job in mine for spec in _outputs(job)]))
    outputs = {id(job): [next(stores) for _ in _outputs(job)] for job in mine}
    reads = _Reads(source, [item for job, units in zip(jobs, owned) for unit in units for item in _work(job, unit)])
    source_bytes = 0
    for number, (job, units) in enumerate(zip(jobs, owned)):
      for unit in units:
        step = _two_pass if job.two_pass else _one_slice
        source_bytes += step(job, unit, reads, quantizers, writer, outputs[id(job)], progress)
      progress(0, 1)
      if number == len(jobs) // 2:
        atomic.test_point("arrays", before=writer.wait)
    writer.wait()
  except BaseException:
    if reads is not None:
      reads.close()
    writer.abandon()  # no background write may outlive the temporary directory
    raise
  finally:
    quantizers.close()
  return writer, Written(copied, source_bytes, writer.written_bytes)


def _slice_bytes(job: ArrayJob, index: tuple[slice, ...]) -> int:
  return math.prod(s.stop - s.start for s in index) * np.dtype(job.leaf.dtype).itemsize


def _one_slice(job: ArrayJob, unit, reads: _Reads, quantizers, writer: orbax_writer.OrbaxArrayWriter, outputs: list,
               progress) -> int:
  """Reads, quantizes (or copies) and writes the one slice of `unit`; returns its source bytes."""
  from inspect_tool.fp8_export import read as read_lib  # pylint: disable=import-outside-toplevel

  index = unit[0]
  value, wq, nbytes = reads.take(), job.quant, _slice_bytes(job, index)
  if job.stored is not None:
    if value is not None:  # every chunk stored: copied as it is
      writer.write_stored(outputs[0], value, nbytes)
    else:
      writer.write_slice([(outputs[0], index, reads.read_again(index))])
  elif wq is None:
    writer.write_slice([(outputs[0], index, value)])
  else:
    value = read_lib.to_jax(value)  # the slice itself when aligned, else a copy (the numpy one freed)
    qvalue, scale = quantizers.quantize(value, wq)  # one call: the slice is already within budget
    del value
    writer.write_slice([(outputs[0], index, np.asarray(qvalue)),
                        (outputs[1], _scale_index(index, wq), np.asarray(scale))])
  progress(nbytes, 0)
  return nbytes


def _two_pass(job: ArrayJob, unit, reads: _Reads, quantizers, writer: orbax_writer.OrbaxArrayWriter, outputs: list,
              progress) -> int:
  """Quantizes one group of blocks that share channels in two passes (absmax, then quantize with it); writes
  every block's qvalue and, once, the group's scale. Returns the source bytes of the group."""
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from inspect_tool.fp8_export import read as read_lib  # pylint: disable=import-outside-toplevel

  wq, amax, value = job.quant, None, None
  for index in unit:
    value = read_lib.to_jax(reads.take())
    part = quantizers.absmax(value, wq)
    amax = part if amax is None else jnp.maximum(amax, part)
    progress(_slice_bytes(job, index) // 2, 0)
  for i, index in enumerate(reversed(unit)):
    taken = reads.take()
    if i:
      value = read_lib.to_jax(taken)
    qvalue, scale = quantizers.quantize_block(value, amax, wq)
    value = None
    parts = [(outputs[0], index, np.asarray(qvalue))]
    if i == 0:
      parts.append((outputs[1], _scale_index(index, wq), np.asarray(scale)))
    writer.write_slice(parts)
    nbytes = _slice_bytes(job, index)
    progress(nbytes - nbytes // 2, 0)
  return sum(_slice_bytes(job, index) for index in unit)


STEP, ITEM = 0, "items"  # MaxText's converter layout: DST/0/items


def write_checkpoint(jobs: Sequence[ArrayJob], source, tmp: str, dst: str, *, label: str,
                     step: bool = False) -> Written:
  """Writes the arrays of `jobs` as the Orbax checkpoint `tmp/0/items`, every process its share, process 0 the
  metadata once all have written (and, with `step`, MaxText's scalar `step` = 0 as its converter does); a progress
  bar named `label`. A write error names `dst`, not `tmp`."""
  import os  # pylint: disable=import-outside-toplevel

  from inspect_tool import errors, progress  # pylint: disable=import-outside-toplevel
  from inspect_tool.distributed import runtime as distributed  # pylint: disable=import-outside-toplevel
  from quant import errors as quant_errors  # pylint: disable=import-outside-toplevel

  index, count = distributed.process_index(), distributed.process_count()
  step_dir = os.path.join(tmp, str(STEP))
  items_dir = os.path.join(step_dir, ITEM)
  os.makedirs(items_dir, exist_ok=True)
  total = sum(math.prod(job.leaf.shape) * np.dtype(job.leaf.dtype).itemsize for job in jobs)
  try:
    with progress.ByteProgress(label, total, len(jobs)) as bar:
      writer, written = write_arrays(jobs, source, items_dir, process_index=index, process_count=count,
                                     on_slice=bar.update)
    distributed.barrier("checkpoint written")
    if index == 0:
      if step:
        writer.write_scalar(("step",), 0, np.int64)
      writer.finalize(step_dir, ITEM, count)
  except quant_errors.QuantError as e:
    if index:
      _remove_share(tmp, items_dir, index)
    raise errors.InputError(str(e).replace(tmp, dst)) from None
  except BaseException:
    if index:
      _remove_share(tmp, items_dir, index)
    raise
  return written


def _remove_share(tmp: str, items_dir: str, index: int) -> None:
  """Process `index` (not 0) of a failed job: removes its database, and the directories up to `tmp` once empty
  (process 0 removes `tmp`; writing after that recreates the path without the marker that lets a later run
  reclaim it)."""
  import os  # pylint: disable=import-outside-toplevel
  import shutil  # pylint: disable=import-outside-toplevel

  shutil.rmtree(os.path.join(items_dir, orbax_writer.PROCESS_DIR.format(index)), ignore_errors=True)
  for directory in (items_dir, os.path.dirname(items_dir), tmp):
    try:
      os.rmdir(directory)
    except OSError:
      break

