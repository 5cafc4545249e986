"""`--layout deepseek-fp8` / `deepseek-v4`: the quantized tensors (attention, dense MLP, shared and routed experts),
read in blocks of a leaf and converted matrix by matrix: each Linear weight transposed to Hugging Face's (out, in)
and stored as its `Codec` says: float8_e4m3fn with one float32 `weight_scale_inv` per 128×128 block (DeepSeek-V3's
release; powers of two with `scale_fmt: ue8m0`, V3.1's), the same with float8_e8m0fnu `.scale` blocks (V4's), FP4
(V4's routed experts: `quant.microscaling`), or bfloat16 (`--layout deepseek-bf16`). `write_hf` / `write_v4`
place the tensors and plan the memory.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import math
from typing import Callable, Iterator, Sequence

import jax
import ml_dtypes
import numpy as np

from inspect_tool.hf import names as hf_names
from inspect_tool.hf import names_v4 as hf_names_v4
from inspect_tool.hf.names import BF16, BF16_LINEAR, BLOCK, EXPERTS_FP8, F32, FP8
from inspect_tool.fp8_export import hf_rows
from inspect_tool.streaming import budget
from inspect_tool.streaming import read as read_lib
from inspect_tool.streaming import read_plan
from quant import dequant_error
from quant import fp8
from quant import microscaling
from quant import microscaling_quantize

MATRIX_KINDS = (FP8, EXPERTS_FP8, hf_names_v4.GROUPED_FP8)  # leaves written matrix by matrix, by a `Codec`
MAX_READ_BYTES = 128 * 2**20  # float32 bytes of a block of an FP8 leaf read at once (two are held)
CONVERTERS = 2  # FP8 matrices converted at once where the budget holds their work (numpy and XLA free the GIL)
FP8_MAX = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)  # a block's absmax over its scale (448)


@functools.cache
def _jitted_block_quantize(power_of_two: bool = False):
  # Fused (~5x faster than op-by-op on CPU), the transpose to (out, in) inside: XLA's is faster than numpy's copy.
  # The dequantization error per block comes out of the same step (the manifest's tally).
  def quantize(w_io, block, qtype):
    qvalue, scale_inv = fp8.block_quantize(w_io.T, block, qtype, power_of_two=power_of_two)
    return qvalue, scale_inv, dequant_error.block_figures(w_io.T, qvalue, scale_inv, block)
  return jax.jit(quantize, static_argnums=(1, 2))


@functools.cache
def _jitted_fp4_quantize():
  def quantize(w_io):
    packed, codes = microscaling_quantize.fp4_quantize(w_io.T)
    return packed, codes, dequant_error.group_figures(w_io.T, packed, codes, microscaling.FP4_GROUP)
  return jax.jit(quantize)


@dataclasses.dataclass(frozen=True)
class Codec:
  """How a matrix of an FP8-kind leaf is stored: `fmt` "fp8" (e4m3 values, a scale per 128×128 block), "fp4"
  (packed e2m1, an e8m0 scale per 32 values of a row) or "bf16"; `power_of_two` scales (ue8m0); `e8m0` stores the
  scales as float8_e8m0fnu bytes (V4), else float32; `v4_names`: the scale of `<x>.weight` is `<x>.scale` (V4's
  release), else `<name>_scale_inv`."""

  fmt: str = "fp8"
  power_of_two: bool = False
  e8m0: bool = False
  v4_names: bool = False

  def scale_name(self, name: str) -> str:
    return name[:-len("weight")] + "scale" if self.v4_names else name + "_scale_inv"

  def regions(self, writer, name: str, shape: tuple[int, int]) -> tuple:
    if self.fmt == "bf16":
      return (writer.reserve(name, ml_dtypes.bfloat16, shape),)
    if self.fmt == "fp4":
      return (writer.reserve(name, np.int8, (shape[0], shape[1] // 2)),
              writer.reserve(self.scale_name(name), ml_dtypes.float8_e8m0fnu,
                             (shape[0], shape[1] // microscaling.FP4_GROUP)))
    grid = tuple(-(-d // b) for d, b in zip(shape, BLOCK))
    return (writer.reserve(name, ml_dtypes.float8_e4m3fn, shape),
            writer.reserve(self.scale_name(name), ml_dtypes.float8_e8m0fnu if self.e8m0 else np.float32, grid))

  def convert(self, matrix: np.ndarray, name: str, tally=None) -> tuple:
    """The stored arrays of an (in, out) matrix, its HF weight (out, in) converted; `tally` gets the quantizer's
    error figures of the quantized ones."""
    if self.fmt == "bf16":
      return (hf_rows.cast(matrix.T, ml_dtypes.bfloat16),)
    if self.fmt == "fp4":
      microscaling.check_finite(matrix, name)
      packed, codes, (largest, total) = jax.tree.map(np.asarray, _jitted_fp4_quantize()(read_lib.to_jax(matrix)))
      if tally is not None:
        tally.add(name, largest, total, matrix.size, microscaling.e8m0_decode(codes), microscaling.E2M1_MAX)
      return packed.view(np.int8), codes.view(ml_dtypes.float8_e8m0fnu)
    qvalue, scale_inv, (largest, total) = _block_quantize_transposed(
        *((matrix, True) if self.power_of_two else (matrix,)))
    if tally is not None:
      tally.add(name, largest, total, matrix.size, scale_inv, FP8_MAX)
    if self.e8m0:
      return qvalue, np.asarray(microscaling_quantize.e8m0_encode(scale_inv)).view(ml_dtypes.float8_e8m0fnu)
    return qvalue, scale_inv


def _block_quantize_transposed(w_io: np.ndarray, power_of_two: bool = False):
  """(fp8 values, float32 scale_inv, (largest, sum) of the dequantization error per block) of the (out, in) weight
  `w_io.T`, 128×128 blocks, as numpy arrays; `w_io` used in place where it is aligned (`to_jax`)."""
  qvalue, scale_inv, figures = _jitted_block_quantize(power_of_two)(read_lib.to_jax(w_io), BLOCK, "float8_e4m3fn")
  return np.asarray(qvalue), np.asarray(scale_inv, np.float32), tuple(np.asarray(f) for f in figures)


def _expert_axis(entry: hf_names.Entry) -> int | None:
  """The routed-expert axis of a leaf (beside its layer axis); None for other leaves."""
  return (1 if entry.layer_axis == 0 else 0) if entry.rule.kind == EXPERTS_FP8 else None


def hf_matrix_shape(entry: hf_names.Entry) -> tuple[int, int]:
  """The (out, in) shape of one HF weight of a matrix leaf (one layer's, one expert's)."""
  per_layer = list(entry.shape)
  if entry.layer_axis is not None:
    del per_layer[entry.layer_axis]
  if entry.rule.kind == hf_names_v4.GROUPED_FP8:
    g, i, o = per_layer
    return (g * o, i)
  matrix = per_layer[1:] if entry.rule.kind == EXPERTS_FP8 else per_layer
  return (math.prod(matrix[entry.rule.n_in:]), math.prod(matrix[:entry.rule.n_in]))


def _fp8_regions(writer, entry: hf_names.Entry, codec: Codec) -> dict[tuple[int, int], tuple]:
  """Places every matrix tensor of a leaf (with its scale), in release order (layer, then expert):
  (stack index, expert) -> regions."""
  rule, experts = entry.rule, entry.rule.kind == EXPERTS_FP8
  shape = hf_matrix_shape(entry)
  per_layer = [d for axis, d in enumerate(entry.shape) if axis != entry.layer_axis]
  layers = entry.layers or (None,)
  regions = {}
  for s, layer in enumerate(layers if entry.layer_axis is not None else layers[:1]):
    name = rule.names[0].replace("{i}", str(layer))
    for j in range(per_layer[0] if experts else 1):
      regions[s, j] = codec.regions(writer, name.replace("{j}", str(j)), shape)
  return regions


def _blocks(read: Callable[[tuple[slice, ...]], np.ndarray], cut: budget.Slicing,
            ahead: bool) -> Iterator[tuple[tuple[slice, ...], np.ndarray]]:
  """(index, `read(index)`) of every block of `cut`, in order; with `ahead`, block k+1 is read in a background
  thread while the caller converts block k (the caller drops block k before asking for the next)."""
  slices = list(cut.slices())
  if not ahead or len(slices) < 2:
    for index in slices:
      yield index, read(index)
    return
  with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="read-ahead") as pool:
    pending = pool.submit(read, slices[0])
    for k, index in enumerate(slices):
      block = pending.result()
      if k + 1 < len(slices):
        pending = pool.submit(read, slices[k + 1])
      yield index, block
      del block


def write_leaf(writer, value, entry: hf_names.Entry, cfg, spare: int, chunk: Sequence[int] | None,
               codec: Codec = Codec(), overhead: Callable[[Sequence[int]], int] = lambda box: 0,
               tally=None) -> None:
  """Quantizes and writes every FP8 matrix of a leaf (a layer's projection, or one routed expert of a layer).

  The leaf is read in blocks cut along its expert axis, then its layer axis, whose sides are whole multiples of
  the source's `chunk` sides (`read_plan.plan_boxes`), so that each source chunk is decoded once, not once per
  layer and expert: two blocks (the next read while the current is converted) when `spare` holds two with the
  chunks decoded into them (`overhead(block)`), else one; at most `MAX_READ_BYTES` of float32 each. Every matrix
  is quantized whole (its scales must not depend on how the leaf is cut) and written at the place `_fp8_regions`
  gave it, `CONVERTERS` matrices at once when `spare` also holds their work beside the blocks (one else); a
  block's matrices are all written before the next block is taken. Each routed expert is quantized alone, not in
  a batch: quant/fp8's scales for a batch of matrices can differ by an ulp from those of each matrix alone (XLA
  computes absmax/448 through a reciprocal differently by shape), and an expert's bytes must not depend on its
  neighbours. `tally` (`manifest.tally.Tally`) sees every quantized matrix beside its source.
  """
  regions = _fp8_regions(writer, entry, codec)
  layer_axis = entry.layer_axis
  expert_axis = _expert_axis(entry)
  cuttable = read_axes(entry)
  stream = value.stream_overhead
  most = 2 * MAX_READ_BYTES
  if stream is None:  # source chunks over `MAX_READ_BYTES`: two whole ones where `spare` holds them (read ahead)
    smallest = read_plan.minimal_box(entry.shape, chunk, cuttable)
    most = max(most, 2 * (4 * math.prod(smallest) + int(overhead(smallest))))
  box, ahead, cached, streamed = read_plan.plan_boxes(entry.shape, 4, chunk, min(spare, most), cuttable, overhead,
                                                      cached=value.cached_reads, stream=stream)
  reads = (1 + ahead) * (4 * math.prod(box) + int(stream if streamed else overhead(box)))
  workers = CONVERTERS if reads + budget.SLICE_FACTOR * unit_bytes(entry) <= spare else 1
  cut = budget.Slicing(tuple(entry.shape), box)
  read = value.stream if streamed else (lambda index: np.asarray(value[index]))
  blocks = ((index, value.cached(index)) for index in cut.slices()) if cached else _blocks(read, cut, ahead)

  def convert(kernel, places) -> None:
    matrix = hf_names_v4.linear_matrix(kernel, entry.rule, cfg)  # (in, out)
    for region, array in zip(places, codec.convert(matrix, places[0].name, tally)):
      region.write(array)

  with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="fp8-convert") as pool:
    for index, block in blocks:
      pending: list[concurrent.futures.Future] = []
      for s in range(index[layer_axis].start, index[layer_axis].stop) if layer_axis is not None else (0,):
        for j in range(index[expert_axis].start, index[expert_axis].stop) if expert_axis is not None else (0,):
          at = [slice(None)] * block.ndim
          if layer_axis is not None:
            at[layer_axis] = s - index[layer_axis].start
          if expert_axis is not None:
            at[expert_axis] = j - index[expert_axis].start
          if len(pending) >= workers:  # at most `workers` matrices' work held at once
            pending.pop(0).result()
          pending.append(pool.submit(convert, block[tuple(at)], regions[s, j]))
      for future in pending:  # the block is done with before the next one is taken
        future.result()
      del block, pending


def unit_bytes(entry: hf_names.Entry) -> int:
  """Float32 bytes of the smallest unit of work of a leaf: one expert, one FP8 matrix, one row of the rest."""
  shape = list(entry.shape)
  if entry.layer_axis is not None:
    del shape[entry.layer_axis]
  rule = entry.rule
  if rule.kind == EXPERTS_FP8 or rule.kind in (BF16, F32):
    shape = shape[1:]
  elif rule.kind == BF16_LINEAR:
    shape = shape[:1] if len(shape) == 2 and rule.n_in == 1 and not rule.rope else shape
  return 4 * math.prod(shape)


def read_axes(entry: hf_names.Entry) -> list[int]:
  """The axes a leaf is read in blocks along: expert and layer axes of FP8 leaves; `hf_rows.read_axis` else."""
  if entry.rule.kind in MATRIX_KINDS:
    return [axis for axis in (_expert_axis(entry), entry.layer_axis) if axis is not None]
  axis = hf_rows.read_axis(entry)
  return [] if axis is None else [axis]
