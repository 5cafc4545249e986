"""Pass 1 of streamed two-pass weights, run ahead: the absmax of an array stored as one chunk, gathered by a thread
of its own while the export works on the arrays before it, so that the export's own reads decode the chunk once
(pass 2) and a second core does the other decode.

A weight gets it (`ArrayJob.ahead_box`) when its plan is streamed and two-pass and the budget still plans every
array once `need` bytes are set aside (`plan`): the gathering holds a stream of its own (the stream's windows, as
`read.CheckpointSource.stream_overhead` counts them), one run of `BOX_BYTES` at most and `budget.SLICE_FACTOR`
times that run for the absmax; one weight at a time, in the export's order. The absmax is exact (a maximum), so
the scales are the same whatever the runs: bit for bit those of pass 1 over the export's own boxes.
"""

from __future__ import annotations

import concurrent.futures
import math
import threading

import numpy as np

from inspect_tool.streaming import budget
from inspect_tool.streaming import read as read_lib
from inspect_tool.streaming import read_plan

BOX_BYTES = 4 * 2**20  # one run of the array (contiguous in C order) read and reduced at a time


def run_box(shape, itemsize: int) -> tuple[int, ...]:
  """The runs' box: sides of 1 before one partial axis, whole axes after (one run of the array in C order)."""
  return read_plan.aligned_box(shape, None, itemsize, BOX_BYTES, tuple(range(len(shape))))


def need(job) -> int:
  """Bytes the gathering of streamed `job`'s absmax holds: a stream's windows (what its own reads hold beside a
  box, `ArrayJob.read_bytes`), a run and the absmax's temporaries."""
  itemsize = np.dtype(job.leaf.dtype).itemsize
  run = math.prod(run_box(job.leaf.shape, itemsize)) * itemsize
  return job.read_bytes - math.prod(job.read_block) * itemsize + (1 + budget.SLICE_FACTOR) * run


class AbsmaxAhead:
  """Gathers, in one background thread and in order, the absmax of every job with an `ahead_box`."""

  def __init__(self, source, jobs, quantizers):
    self._source, self._quantizers, self._stop = source, quantizers, threading.Event()
    self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="absmax-ahead")
    self._futures = {id(job): self._pool.submit(self._gather, job) for job in jobs if job.ahead_box}

  def amax(self, job):
    """The absmax of the whole weight over its shared axes (the scale's shape, 1 on shared axes): the
    `compute_dtype` values of pass 1."""
    return self._futures[id(job)].result()

  def _gather(self, job):
    wq, shape = job.quant, tuple(job.leaf.shape)
    whole = None
    stream = self._source.new_stream(job.leaf.key)
    try:
      buffer = read_lib.aligned_empty(job.ahead_box, job.leaf.dtype)
      for index in read_plan.boxes(shape, job.ahead_box):
        if self._stop.is_set():
          raise concurrent.futures.CancelledError()
        sides = [s.stop - s.start for s in index]
        value = buffer.reshape(-1)[:math.prod(sides)].reshape(sides)
        stream.read_async(index, value).result()
        part = np.asarray(self._quantizers.absmax(read_lib.to_jax(value), wq))
        value = None
        if whole is None:
          whole = np.zeros([d if axis in wq.channel_axes else 1 for axis, d in enumerate(shape)], part.dtype)
        region = tuple(s if axis in wq.channel_axes else slice(0, 1) for axis, s in enumerate(index))
        whole[region] = np.maximum(whole[region], part)
    finally:
      stream.close()
    return whole

  def close(self) -> None:
    """Stops gathering (the export ended or failed) and waits for the thread."""
    self._stop.set()
    self._pool.shutdown(wait=True, cancel_futures=True)
