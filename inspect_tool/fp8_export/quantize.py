"""Export stage 3, quantize: the compiled quantizer of every block shape the export will meet.

Each distinct (block shape, dtype, granularity) needs its own XLA executable, and compiling one takes 50-100 ms
on a CPU; an export meets tens of them. `Quantizers` compiles them all in a background thread, in the order the
blocks come, while the first arrays are read and written, instead of one by one when each block arrives
(`quant.ptq_weights.compiled_quantizers`: the same executables the jitted calls build, so the same values). Each
quantizer also measures the block's dequantization error in the same step (for the manifest's `tally`).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools

import jax
import numpy as np

from inspect_tool.streaming import read as read_lib
from quant import ptq_weights


def _block_shapes(job) -> list[tuple[int, ...]]:
  """The distinct shapes of `job`'s slices (the edge slices of each axis included), the first slice's first; then
  those of the runs its absmax is gathered ahead in (`absmax_ahead`)."""
  out = _shapes(job.slicing.shape, job.slicing.block)
  if job.ahead_box:
    out += [s for s in _shapes(job.slicing.shape, job.ahead_box) if s not in out]
  return out


def _shapes(shape, block) -> list[tuple[int, ...]]:
  sides = [[b] + ([d % b] if d % b else []) for d, b in zip(shape, block)]
  out = [tuple(min(b, d) for b, d in zip(block, shape))]
  for combo in itertools.product(*sides):
    if combo not in out:
      out.append(combo)
  return out


class Quantizers:
  """The quantizers of `jobs`' quantized blocks, compiled in order by one background thread."""

  def __init__(self, jobs):
    self._sharding = jax.sharding.SingleDeviceSharding(read_lib.compute_device())  # where `read.to_jax` puts blocks
    self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="compile-quantizers")
    self._compiled: dict[tuple, concurrent.futures.Future] = {}
    for job in jobs:
      if job.quant is None:
        continue
      for shape in _block_shapes(job):
        key = self._key(shape, job.leaf.dtype, job.quant, job.two_pass)
        if key not in self._compiled:
          self._compiled[key] = self._pool.submit(ptq_weights.compiled_quantizers, shape, job.leaf.dtype,
                                                  _normalized(job.quant), two_pass=job.two_pass,
                                                  sharding=self._sharding, measured=True)

  @staticmethod
  def _key(shape, dtype, wq, two_pass: bool) -> tuple:
    return (tuple(int(d) for d in shape), np.dtype(dtype).name, _normalized(wq), bool(two_pass))

  def _get(self, x, wq, two_pass: bool) -> tuple:
    return self._compiled[self._key(x.shape, x.dtype, wq, two_pass)].result()

  def quantize(self, x, wq):
    """(qvalue, scale, error) of a slice `x` that spans every shared axis of the weight `wq`: the qvalue as a numpy
    array, `error` the dequantization error's (largest, sum) per channel (`quant.dequant_error.channel_figures`)."""
    qvalue, scale, error = self._get(x, wq, False)[0](x)
    return ptq_weights.as_qtype(qvalue, wq.qtype, x.shape), scale, error

  def absmax(self, x, wq):
    """Pass 1 of a two-pass job: the absmax of the block `x` over the weight's shared axes."""
    return self._get(x, wq, True)[0](x)

  def quantize_block(self, x, amax, wq):
    """Pass 2: (qvalue, scale, error) of the block `x` given the absmax of every block that shares its channels."""
    qvalue, scale, error = self._get(x, wq, True)[1](x, amax)
    return ptq_weights.as_qtype(qvalue, wq.qtype, x.shape), scale, error

  def close(self) -> None:
    """Stops compiling (an export that fails or ends); waits for the compile under way."""
    self._pool.shutdown(wait=True, cancel_futures=True)


def _normalized(wq):
  """`wq` without what does not change the compiled quantizer (its key, shape and consuming ops)."""
  return dataclasses.replace(wq, key=(), shape=(), ops=())
