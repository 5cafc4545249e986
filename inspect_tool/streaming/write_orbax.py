"""Every array into an Orbax checkpoint, slice by slice, copied or quantized by the quantizers given (export stages 3
and 4; an import copies).

Layout (Orbax, OCDBT + zarr3, the MaxText converter layout): `DST/0/items/params/params/<module path>/<name>`
for copied arrays, `.../<name>/array/qvalue` (float8_e4m3fn, the weight's shape) and `.../<name>/array/scale`
(the weight's rank, 1 on shared axes) for quantized ones — Qwix PTQ's layout, used for experts too. Scanned
stacks stay scanned (layer axis at `param_scan_axis`), so e.g. the experts `MoeBlock_0/wi_0` (X, L, E, F) get
a scale of shape (1, L, 1, F) and a dense `wq_b/kernel` (R, L, H, D) one of (1, L, H, D). Scales are stored in
the dtype the forward pass quantizes in (the compute dtype, bfloat16 by default): exactly Qwix PTQ's scales, and
exactly (in value) the float32 scales of the FP8 grouped matmul. Everything, the gate bias included, is written
under `params/params` (MaxText's params-only loaders find the bias there too).

Writing: each array is read in chunk-aligned boxes and processed in slices that fit the memory budget
(`read_plan`: a box bigger than a slice may be is read once and cut in memory, or its slices read through a chunk
cache holding its decoded chunks when they do not fit beside it, so no source chunk is decoded for every slice;
`box_reads`: the next box read ahead when the budget holds it); a slice is quantized (`quantize`'s compiled
quantizers: a slice along channel axes gets exactly the whole weight's scales; the slices of a two-pass weight get
their absmax from a first pass) and written into the destination zarr3 array, chunked by a sub-block of the slice,
through tensorstore. As Orbax does, each process writes into its own OCDBT database
(`items/ocdbt.process_<i>/`), and process 0 merges them into the checkpoint's root database and writes `_METADATA`
(the pytree: Orbax's format, `use_ocdbt`, `use_zarr3`) and the step's `_CHECKPOINT_METADATA`. With several
processes (`jax.distributed`), process `i` handles every unit of work (a slice; a two-pass group of blocks) whose
running number is `i` modulo the process count. A copied array from a zarr3 source is cut in whole chunks and
keeps the source's metadata and chunks: their stored bytes are copied, not decoded and encoded again.
"""

from __future__ import annotations

import dataclasses
import math
import os
import types
from typing import Any, Callable, Sequence

import jax.numpy as jnp
import numpy as np

from inspect_tool import errors
from inspect_tool import progress
from inspect_tool.distributed import runtime as distributed
from inspect_tool.output import atomic
from inspect_tool.paramtree import tree
from inspect_tool.storage import paths
from inspect_tool.streaming import absmax_ahead
from inspect_tool.streaming import box_reads
from inspect_tool.streaming import budget as budget_lib
from inspect_tool.streaming import orbax_writer
from inspect_tool.streaming import read as read_lib
from inspect_tool.streaming import read_plan
from quant import errors as quant_errors
from quant import fp8
from quant import ptq_weights

@dataclasses.dataclass(frozen=True)
class Written:
  """What `write_arrays` wrote: the copied leaves and the bytes read and written (by this process)."""

  copied: list
  source_bytes: int
  written_bytes: int
  boxes_read_ahead: int = 0  # boxes whose read started while an earlier one was processed (`box_reads`)
  items_dir: str = ""  # where the arrays went: the items' directory, absolute (or a normalized gs:// URL)


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
  box: tuple[int, ...] = ()  # what one read holds, aligned to the source's chunks (default: the slice block)
  ahead: bool = True  # its plan holds two of its boxes: its next box can be read while this one is processed
  cached: bool = False  # the box's slices are read through a chunk cache of its own (`read.cached_box`)
  streamed: bool = False  # the array's one chunk is decoded front to back into its boxes (`chunk_stream`)
  read_bytes: int = 0  # what reading one box holds: the box and the chunks being decoded into it
  room: int = 0  # the bytes its plan had beside the process: what boxes read ahead may fill (`box_reads`)
  ahead_box: tuple[int, ...] = ()  # streamed two-pass: pass 1 gathered ahead in runs of this box (`absmax_ahead`)

  @property
  def slice_bytes(self) -> int:
    return int(np.prod(self.slicing.block, dtype=np.int64)) * np.dtype(self.leaf.dtype).itemsize

  @property
  def read_block(self) -> tuple[int, ...]:
    return tuple(self.box) or self.slicing.block

  def units(self) -> list[list[tuple[slice, ...]]]:
    """The units of work, in order, each a list of boxes: one box; for a two-pass job, the boxes that share
    channels (their absmax is gathered over all of them before any is quantized)."""
    boxes = read_plan.boxes(self.slicing.shape, self.read_block)
    if not self.two_pass:
      return [[index] for index in boxes]
    if self.streamed:  # the whole array in each pass, front to back: its chunk is decoded twice
      return [boxes]
    groups: dict[tuple, list] = {}
    for index in boxes:
      groups.setdefault(_channels(index, self.quant), []).append(index)
    return list(groups.values())

  def slices_in(self, box: tuple[slice, ...]) -> list[tuple[slice, ...]]:
    """The slices of the box `box` (absolute indices), in order."""
    return read_plan.slices_in(box, self.slicing.block)

  def second_pass(self, unit: list[tuple[slice, ...]]) -> list[tuple[slice, ...]]:
    """The boxes of a two-pass unit in the order pass 2 reads them: in reverse, the first (the last of pass 1) kept
    in memory; streamed, front to back again."""
    return list(unit) if self.streamed else list(reversed(unit))


def _channels(index: tuple[slice, ...], wq) -> tuple:
  return tuple((s.start, s.stop) for axis, s in enumerate(index) if axis in wq.channel_axes)


CHUNK_BYTES = 32 * 2**20  # at most this much per destination chunk
DECODING_CHUNKS = read_lib.DECODING_CHUNKS  # source chunks decoded at once


def plan_jobs(plan, source, max_memory: int, held: int | None = None) -> list[ArrayJob]:
  """Plans the reads of every source array so that the process stays under `max_memory` bytes (`read_plan`).

  What is left after the memory the process already holds (`held`, default: its resident memory now: Python, JAX, the
  plan; plus `budget.reserve_bytes`) holds one chunk-aligned box (two with read-ahead), the chunks being decoded into
  it and `budget.SLICE_FACTOR` times a slice. A weight is quantized in one pass when a box that spans every axis its
  scales are shared over fits, each source chunk decoded once; else, with absmax scales, in two passes over boxes cut
  along the source's chunks on every axis (`ArrayJob.two_pass`): the first gathers the absmax of the boxes that share
  channels, the second quantizes them, each chunk decoded twice. A streamed two-pass weight gets its pass 1 gathered
  ahead by a thread of its own (`absmax_ahead`) when every array still plans with what that holds set aside.

  Raises:
    errors.InputError: `max_memory` is smaller than what the smallest read of some array needs; the line names
      the smallest budget that works for every array.
  """
  held = budget_lib.current_rss() if held is None else held
  jobs = _plan_jobs(plan, source, max_memory, held)
  ahead = [job for job in jobs if job.two_pass and job.streamed]
  if not ahead:
    return jobs
  aside = max(absmax_ahead.need(job) for job in ahead)
  try:
    fewer = _plan_jobs(plan, source, max_memory - aside, held)
  except errors.InputError:
    return jobs
  ahead = [job for job in fewer if job.two_pass and job.streamed]
  if not ahead or max(absmax_ahead.need(job) for job in ahead) > aside:
    return jobs
  return [dataclasses.replace(job, ahead_box=absmax_ahead.run_box(job.leaf.shape, np.dtype(job.leaf.dtype).itemsize))
          if job.two_pass and job.streamed else job for job in fewer]


def _plan_jobs(plan, source, max_memory: int, held: int) -> list[ArrayJob]:
  """`plan_jobs` without gathering ahead."""
  held += budget_lib.reserve_bytes(bool(plan.weights))
  jobs, short = [], []
  for key in source.keys():
    leaf = source.leaf(key)
    wq = plan.weights.get(key)
    itemsize = np.dtype(leaf.dtype).itemsize
    every_axis = tuple(range(len(leaf.shape)))
    channels = tuple(wq.channel_axes) if wq is not None else every_axis
    store = source.open(key)
    align = source.chunk_shape(store)
    args = dict(channel_axes=channels, two_pass_allowed=wq is not None and ptq_weights.gathers_absmax(wq),
                overhead=lambda box, store=store: source.read_overhead(store, box),
                stored=(lambda box, store=store: source.cached_overhead(store, box))
                if align and source.cached_reads else None,  # a source with cached reads
                stream=source.stream_overhead(store))
    found = read_plan.plan_reads(leaf.shape, itemsize, align, max_memory - held, **args)
    if found is None:
      chunk_bytes = source.chunk_bytes(store)
      decoding = (f"a stream of its one stored chunk, {budget_lib.format_size(args['stream'])}" if args["stream"]
                  else f"decoded source chunks of {budget_lib.format_size(chunk_bytes)}" if chunk_bytes else "")
      short.append((held + read_plan.floor(leaf.shape, itemsize, align, **args), key, tuple(leaf.shape), decoding))
      continue
    cut = budget_lib.Slicing(tuple(leaf.shape), found.block)
    out_key = tree.param_key(leaf.module_path)  # converter layout: everything under params/params
    stored = _stored_layout(source, store, found) if wq is None else None
    chunk = budget_lib.chunk_within(cut.block, itemsize, CHUNK_BYTES, every_axis if found.two_pass else channels)
    if stored is not None:
      chunk = tuple(stored["chunk_grid"]["configuration"]["chunk_shape"])
    read_bytes = math.prod(found.box) * itemsize + int(
        args["stream"] if found.streamed else source.read_overhead(store, found.box))
    jobs.append(ArrayJob(tree.Leaf(key, tuple(leaf.shape), leaf.dtype), out_key, wq, cut, chunk, stored,
                         found.two_pass, found.box, found.ahead, found.cached, found.streamed, read_bytes,
                         max_memory - held))
  if short:  # name the array that needs the most: its need is the smallest budget that works for every array
    need, key, shape, decoding = max(short, key=lambda item: item[0])
    raise errors.InputError(
        f"--max-memory {budget_lib.format_size(max_memory)} is smaller than the smallest slice of "
        f"{'/'.join(key)} {shape} needs (with the {budget_lib.format_size(held)} the process holds"
        f"{' and ' + decoding if decoding else ''}); accepted: at least {budget_lib.format_size(need)}")
  return sorted(jobs, key=lambda job: job.quant is not None)  # copies first: the quantizers compile meanwhile


def _stored_layout(source, store, found: read_plan.ReadPlan) -> dict | None:
  """The source array's metadata when its stored chunks can be copied as they are: a box processed whole (no
  in-memory cut) made of whole stored chunks; else None."""
  stored = source.stored_layout(store)
  if stored is None or found.box != found.block or found.cached or found.streamed:
    return None
  chunk = stored["chunk_grid"]["configuration"]["chunk_shape"]
  shape = tuple(int(d) for d in store.shape)
  if len(chunk) != len(shape) or any(b % c and b != d for b, c, d in zip(found.box, chunk, shape)):
    return None
  return stored


def _scale_index(index: tuple[slice, ...], wq) -> tuple[slice, ...]:
  """The part of the scale array that the weight slice `index` determines."""
  return tuple(s if axis in wq.channel_axes else slice(0, 1) for axis, s in enumerate(index))


def _scale_chunk(block: tuple[int, ...], wq) -> tuple[int, ...]:
  return tuple(b if axis in wq.channel_axes else 1 for axis, b in enumerate(block))


def destination_arrays(job: ArrayJob) -> list[tuple]:
  """(key, shape, dtype, chunk[, metadata]) of the destination arrays of `job`: the copy (with the source's
  metadata when its stored chunks are copied), or the qvalue and the scale."""
  wq, leaf, block = job.quant, job.leaf, job.chunk or job.slicing.block
  if wq is None:
    return [(job.out_key, leaf.shape, leaf.dtype, block, job.stored)]
  return [(wq.qvalue_key, leaf.shape, wq.qtype, block),
          (wq.scale_key, wq.scale_shape, wq.compute_dtype, _scale_chunk(block, wq))]


def _work(job: ArrayJob, unit: list[tuple[slice, ...]]) -> list[tuple[ArrayJob, tuple[slice, ...], str]]:
  """The reads of one unit of `job`: its box; or, two-pass, every box for the absmax, then every box again in
  `ArrayJob.second_pass` order for quantizing (unless streamed, the first of them, the last read, kept from pass 1)."""
  if not job.two_pass:
    return [(job, index, box_reads.SLICE) for index in unit]
  if job.ahead_box:  # pass 1 is gathered ahead (`absmax_ahead`)
    return [(job, index, box_reads.SLICE) for index in job.second_pass(unit)]
  return ([(job, index, box_reads.ABSMAX) for index in unit]
          + [(job, index, box_reads.REUSE if i == 0 and not job.streamed else box_reads.SLICE)
             for i, index in enumerate(job.second_pass(unit))])


def write_arrays(jobs: Sequence[ArrayJob], source, items_dir: str, *, process_index: int = 0,
                 process_count: int = 1, on_slice: Callable[[int, int], None] | None = None,
                 quantizers: Callable[[Sequence[ArrayJob]], Any] | None = None, tally=None, digests=None):
  """Reads, quantizes and writes every unit of work of `jobs` that this process owns into `items_dir`'s arrays.

  `quantizers(jobs)` gives the quantizers of the quantized jobs (`fp8_export.quantize.Quantizers`: `quantize`,
  `absmax`, `quantize_block`, `close`); without it every job must be a copy (`ArrayJob.quant` None).

  Three stages overlap: the next boxes are read (tensorstore threads; as far as `ArrayJob.room` holds them,
  `box_reads`) while the slices of this one are quantized, and the earlier slices' outputs are encoded and written
  meanwhile: the last one's always, more as far as the room left beside the boxes and the slice's work holds
  them (`_write_room`; on gs:// each write is a request, and the store takes them in parallel).
  A two-pass job (`ArrayJob.two_pass`) reads each group of boxes that share channels twice: their absmax first,
  then the boxes again to quantize them; the scale of each channel range is written with its first slice.
  `on_slice(source_bytes, arrays_done)` is called after each slice (half the bytes per pass of a two-pass job) and
  array (progress). The checkpoint is complete once every process has returned and process 0 has called
  `finalize` on the returned writer. With several processes, process `i` owns every unit whose running number is
  `i` modulo the process count. `tally` (`manifest.tally.Tally`) gets the quantizer's error figures of every
  quantized slice; `digests` (`manifest.digests.Digests`) hashes every array written whole here as it is written.

  Returns:
    (`orbax_writer.OrbaxArrayWriter`, Written).

  Raises:
    quant.errors.QuantError: a write failed (e.g. disk full) or a weight cannot be quantized.
    errors.CheckpointError: the source cannot be read.
  """
  writer = orbax_writer.OrbaxArrayWriter(items_dir, process_index=process_index, digests=digests)
  copied, running, owned = [], 0, []
  for job in jobs:
    if job.quant is None:
      copied.append(tree.Leaf(job.out_key, job.leaf.shape, job.leaf.dtype))
    units = job.units()
    owned.append([unit for i, unit in enumerate(units) if (running + i) % process_count == process_index])
    for key, shape, dtype, chunk, *_ in destination_arrays(job):
      writer.register(key, chunk, shape, dtype)
      if digests is not None and len(owned[-1]) == len(units):  # all of it written here
        digests.track(".".join(key), shape, dtype, _spare_room(job))  # boxes out of C order kept there
    running += len(units)
  reads = None
  progress = on_slice or (lambda nbytes, arrays: None)
  mine = [job for job, units in zip(jobs, owned) if units]
  if quantizers is None and any(job.quant is not None for job in mine):
    raise ValueError("write_arrays: quantized jobs need their quantizers")
  # an import quantizes nothing: nothing to compile, nothing to close
  quantizers = quantizers(mine) if quantizers else types.SimpleNamespace(close=lambda: None)
  ahead = absmax_ahead.AbsmaxAhead(source, mine, quantizers)
  try:
    stores = iter(writer.create_many([spec for job in mine for spec in destination_arrays(job)]))
    outputs = {id(job): [next(stores) for _ in destination_arrays(job)] for job in mine}
    work = [item for job, units in zip(jobs, owned) for unit in units for item in _work(job, unit)]
    reads = box_reads.BoxReads(source, work, lambda: writer.in_flight_bytes)
    source_bytes = 0
    for number, (job, units) in enumerate(zip(jobs, owned)):
      for unit in units:
        writer.make_room(_write_room(job, reads))  # what an earlier array's writes hold beside this one's work
        if job.two_pass:
          source_bytes += _two_pass(job, unit, reads, quantizers, writer, outputs[id(job)], progress, ahead, tally)
        else:
          source_bytes += _one_slice(job, unit, reads, quantizers, writer, outputs[id(job)], progress, tally)
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
    ahead.close()
    quantizers.close()
    source.close_stream()
  return writer, Written(copied, source_bytes, writer.written_bytes, reads.read_ahead if reads is not None else 0,
                         writer.items_dir)


def _write_room(job: ArrayJob, reads: box_reads.BoxReads) -> int:
  """The bytes that writes in flight may hold while `job` is processed: the room its plan had (`ArrayJob.room`)
  less the boxes held and being read and `budget.SLICE_FACTOR` times its slice (a copy of stored chunks, which
  quantizes nothing: its box once more). 0 when none is left (a write then waits for the earlier ones)."""
  work = job.slice_bytes if job.stored is not None else budget_lib.SLICE_FACTOR * job.slice_bytes
  return max(0, job.room - reads.held() - work)


def _spare_room(job: ArrayJob) -> int:
  """The room the plan of `job` leaves beside its boxes (two, read ahead) and its slice's work."""
  return max(0, job.room - (1 + job.ahead) * job.read_bytes - budget_lib.SLICE_FACTOR * job.slice_bytes)


def _slice_bytes(job: ArrayJob, index: tuple[slice, ...]) -> int:
  return math.prod(s.stop - s.start for s in index) * np.dtype(job.leaf.dtype).itemsize


def _relative(index: tuple[slice, ...], box: tuple[slice, ...]) -> tuple[slice, ...]:
  return tuple(slice(s.start - b.start, s.stop - b.start) for s, b in zip(index, box))


def _one_slice(job: ArrayJob, unit, reads: box_reads.BoxReads, quantizers, writer: orbax_writer.OrbaxArrayWriter,
               outputs: list, progress, tally=None) -> int:
  """Reads the one box of `unit` and quantizes (or copies) and writes it slice by slice (cut in memory); returns
  its source bytes."""
  box = unit[0]
  value, wq = reads.take(), job.quant
  if job.stored is not None:
    nbytes = _slice_bytes(job, box)
    if value is not None:  # every chunk stored: copied as it is
      writer.write_stored(outputs[0], value, nbytes, _write_room(job, reads))
    else:
      writer.write_slice([(outputs[0], box, reads.read_again(box))])
    progress(nbytes, 0)
    return nbytes
  for index in job.slices_in(box):
    part = value[_relative(index, box)]
    if wq is None:
      writer.write_slice([(outputs[0], index, part)], _write_room(job, reads))
    else:
      qvalue, scale, error = quantizers.quantize(read_lib.to_jax(part), wq)  # one call: the slice is within budget
      qvalue, scale = np.asarray(qvalue), np.asarray(scale)
      if tally is not None:
        tally.add(".".join(wq.qvalue_key), *error, part.size, scale, fp8.bound(qvalue.dtype))
      part = None
      writer.write_slice([(outputs[0], index, qvalue), (outputs[1], _scale_index(index, wq), scale)],
                         _write_room(job, reads))
    progress(_slice_bytes(job, index), 0)
  return _slice_bytes(job, box)


def _two_pass(job: ArrayJob, unit, reads: box_reads.BoxReads, quantizers, writer: orbax_writer.OrbaxArrayWriter,
              outputs: list, progress, ahead: absmax_ahead.AbsmaxAhead, tally=None) -> int:
  """Quantizes one group of boxes that share channels in two passes (the absmax of every slice, gathered per
  channels, or by `ahead` for the whole weight; then each slice quantized with it); writes every slice's qvalue
  and, once per channels, the scale. The last box of pass 1 stays in memory for pass 2. Returns the source bytes of
  the group."""
  wq, amax, value = job.quant, {}, None
  whole = ahead.amax(job) if job.ahead_box else None  # pass 1 gathered ahead, for the whole weight
  for box in unit:
    if whole is not None:
      for index in job.slices_in(box):
        amax.setdefault(_channels(index, wq), jnp.asarray(whole[_scale_index(index, wq)]))
    else:
      value = None  # at most one box in memory (besides a box read ahead)
      value = reads.take()
      for index in job.slices_in(box):
        part = quantizers.absmax(read_lib.to_jax(value[_relative(index, box)]), wq)
        channels = _channels(index, wq)
        amax[channels] = part if channels not in amax else jnp.maximum(amax[channels], part)
    progress(_slice_bytes(job, box) // 2, 0)
  scaled = set()
  for i, box in enumerate(job.second_pass(unit)):
    kept = i == 0 and not job.streamed  # the last box of pass 1, still in memory
    if not kept:
      value = None
    taken = reads.take()
    if not kept:
      value, taken = taken, None
    for index in job.slices_in(box):
      channels = _channels(index, wq)
      part = value[_relative(index, box)]
      qvalue, scale, error = quantizers.quantize_block(read_lib.to_jax(part), amax[channels], wq)
      qvalue, scale = np.asarray(qvalue), np.asarray(scale)
      if tally is not None:
        tally.add(".".join(wq.qvalue_key), *error, part.size, scale, fp8.bound(qvalue.dtype))
      parts = [(outputs[0], index, qvalue)]
      if channels not in scaled:
        scaled.add(channels)
        parts.append((outputs[1], _scale_index(index, wq), scale))
      writer.write_slice(parts, _write_room(job, reads))
    nbytes = _slice_bytes(job, box)
    progress(nbytes - nbytes // 2, 0)
  return sum(_slice_bytes(job, box) for box in unit)


STEP, ITEM = 0, "items"  # MaxText's converter layout: DST/0/items


def write_checkpoint(jobs: Sequence[ArrayJob], source, tmp: str, dst: str, *, label: str,
                     step: bool = False, quantizers: Callable | None = None, tally=None, digests=None) -> Written:
  """Writes the arrays of `jobs` as the Orbax checkpoint `tmp/0/items`, every process its share, process 0 the
  metadata once all have written (and, with `step`, MaxText's scalar `step` = 0 as its converter does); a progress
  bar named `label`; `quantizers`, `tally` and `digests` as `write_arrays` takes them. A write error names `dst`,
  not `tmp`."""
  index, count = distributed.process_index(), distributed.process_count()
  place = paths.place(tmp)
  step_dir = f"{place.path}/{STEP}"
  items_dir = f"{step_dir}/{ITEM}"
  if not place.remote:  # a gs:// prefix needs no directories
    os.makedirs(items_dir, exist_ok=True)
  total = sum(math.prod(job.leaf.shape) * np.dtype(job.leaf.dtype).itemsize for job in jobs)
  try:
    with progress.ByteProgress(label, total, len(jobs)) as bar:
      writer, written = write_arrays(jobs, source, items_dir, process_index=index, process_count=count,
                                     on_slice=bar.update, quantizers=quantizers, tally=tally, digests=digests)
    distributed.barrier("checkpoint written")
    if index == 0:
      if step:
        writer.write_scalar(("step",), 0, np.int64)
      writer.finalize(step_dir, ITEM, count)
  except quant_errors.QuantError as e:
    if index:
      orbax_writer.remove_share(tmp, items_dir, index)
    raise errors.InputError(str(e).replace(tmp, dst)) from None
  except BaseException:
    if index:
      orbax_writer.remove_share(tmp, items_dir, index)
    raise
  return written
