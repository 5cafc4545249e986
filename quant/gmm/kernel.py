"""The grouped matmul's TPU kernel (Pallas, compiled by Mosaic): bf16, fp8 or int8 operands, scales in the kernel.

Letters: M rows (tokens × experts per token, sorted by group), K the contracted axis, N output columns, G groups;
tm, tk, tn the tile sizes. `gmm(lhs[M, K], rhs[G, K, N], group_sizes[G])` gives out[M, N] with
`out[r] = lhs[r] @ rhs[g(r)]` (the first `group_sizes[0]` rows belong to group 0, and so on; `rhs[g].T` with
`transpose_rhs`); `tgmm(lhs[M, K], grad[M, N], group_sizes)` gives out[G, K, N] with
`out[g] = lhs[rows of g]^T @ grad[rows of g]` (zero for an empty group): the weight's gradient.

Operands stay in their own dtype in HBM and VMEM (an fp8 or int8 tile moves half the bytes of a bf16 one) and are
widened tile by tile to the matrix unit's type: bfloat16 for bf16 and fp8 (every float8_e4m3fn and float8_e5m2
value is exact in bfloat16, so each product is the exact product of the fp8 values, accumulated in float32, as on an
FP8 matrix unit), int8 × int8 in int32 (the int8 units of v5e, v5p and v6e), float32 at HIGHEST precision (set on
each product, so that JAX_DEFAULT_MATMUL_PRECISION does not reach inside). The optional scales multiply the float32
accumulator once per output tile, before it is rounded to `out_dtype`: `row_scale[M, 1]` (per row of lhs, gmm only)
and `col_scale[1, N]` (per output column).

The grid runs over (N tiles, visits, K tiles) for gmm and (N tiles, K tiles, visits) for tgmm. A visit is one (row
tile, group) pair where the tile holds rows of the group: a row tile holding rows of several groups is visited once
per group, consecutively, and each visit stores only its group's rows. Megablox multiplies the whole row tile on every
such visit; here a visit to a tile that its group fills only in part multiplies only the blocks of `sub_rows` rows
that hold rows of the group, so a group boundary costs at most one block of `sub_rows` rows more, not a whole tile.
Rows past the last group are never stored (undefined: the caller masks them).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
import jax.numpy as jnp

from quant.gmm import target

SUB_ROWS = 128  # rows per block multiplied on its own at a group boundary (the MXU's height on every TPU)
VMEM_CAP = 96 * 2**20  # most VMEM a kernel asks for, below the chip's own (`target.vmem_bytes`)


@dataclasses.dataclass(frozen=True)
class Tiling:
  """Tile sizes of one grouped matmul: rows (tm), contracted (tk) and output columns (tn)."""

  tm: int = 512
  tk: int = 1024
  tn: int = 1024

  def fit(self, m: int, k: int, n: int, row_multiple: int) -> "Tiling":
    """The tiling capped to the problem: tm to the rows rounded up to `row_multiple`, tk and tn to K and N."""
    tm = min(self.tm, -(-m // row_multiple) * row_multiple)
    return Tiling(tm=max(tm, row_multiple), tk=min(self.tk, k), tn=min(self.tn, n))


def mxu_dtype(a, b):
  """The type both operands are widened to: int8 for two int8 operands, float32 when one is float32, else bf16."""
  a, b = jnp.dtype(a), jnp.dtype(b)
  if a == jnp.int8 and b == jnp.int8:
    return jnp.dtype(jnp.int8)
  if jnp.float32 in (a, b):
    return jnp.dtype(jnp.float32)
  return jnp.dtype(jnp.bfloat16)


def row_multiple(*dtypes) -> int:
  """Rows of a tile must be a multiple of this for the narrowest operand's native TPU tiling (8 rows per 32 bits)."""
  return max(8 * 4 // jnp.dtype(d).itemsize for d in dtypes)


def visits(group_sizes, m_tiles: int, tm: int, *, visit_empty: bool):
  """The visits of a grouped matmul: ((offsets[G + 1], group of each visit, row tile of each visit), count).

  Visits run group by group and, within a group, tile by tile, so the visits of a row tile are consecutive. The
  arrays have room for the most visits there can be (m_tiles + G - 1, plus one per empty group with `visit_empty`,
  which tgmm needs to store the zeros of an empty group); the count (traced) is how many are used.
  """
  sizes = group_sizes.astype(jnp.int32)
  g = sizes.shape[0]
  ends = jnp.cumsum(sizes)
  starts = ends - sizes
  offsets = jnp.concatenate([jnp.zeros(1, jnp.int32), ends])
  first = starts // tm
  last = jnp.maximum(ends - 1, starts) // tm
  counts = jnp.where(sizes > 0, last - first + 1, 1 if visit_empty else 0).astype(jnp.int32)
  most = m_tiles + g - 1 + (g if visit_empty else 0)
  group_of = jnp.repeat(jnp.arange(g, dtype=jnp.int32), counts, total_repeat_length=most)
  before = jnp.cumsum(counts) - counts
  tile_of = jnp.clip(first[group_of] + jnp.arange(most, dtype=jnp.int32) - before[group_of], 0, m_tiles - 1)
  return (offsets, group_of, tile_of), jnp.sum(counts)


def tail_visits(meta, count, m_tiles: int, tm: int):
  """`visits`' arrays and count for gmm with a visit after the groups' for every row tile that holds rows past them
  (that tile's last group visit comes just before, so a tile shared with the last group keeps that visit's rows):
  (offsets, group of each visit, row tile of each visit, tail), count. `tail` is 0 for a group's visit and, for a
  tail visit, 1 + the row tile the last group visit read: a tail visit reads nothing new (its blocks are that visit's
  last ones) and only stores zeros. The arrays have room for m_tiles more visits."""
  offsets, group_of, tile_of = meta
  total = offsets[-1]
  first = jnp.minimum(total // tm, m_tiles)  # the first tile holding a row past the groups (m_tiles: none)
  tails = m_tiles - first
  size = group_of.shape[0] + m_tiles
  index = jnp.arange(size, dtype=jnp.int32)
  is_tail = (index >= count) & (index < count + tails)
  last = jnp.maximum(count - 1, 0)
  group_of = jnp.where(is_tail, group_of[last], jnp.pad(group_of, (0, m_tiles)))
  tail = jnp.where(is_tail, tile_of[last] + 1, 0).astype(jnp.int32)
  tile_of = jnp.where(is_tail, jnp.clip(first + index - count, 0, m_tiles - 1), jnp.pad(tile_of, (0, m_tiles)))
  return (offsets, group_of, tile_of, tail), count + tails


def widen(x, dtype):
  """`x` as `dtype` (the matrix unit's type) inside the kernel; unchanged when it already is."""
  return x if x.dtype == dtype else x.astype(dtype)


def _product(a, b, contract, mxu):
  """a · b contracting axes `contract` (lhs axis, rhs axis), accumulated in int32 (int8) or float32."""
  acc = jnp.int32 if mxu == jnp.int8 else jnp.float32
  precision = jax.lax.Precision.HIGHEST if mxu == jnp.float32 else jax.lax.Precision.DEFAULT
  return jax.lax.dot_general(widen(a, mxu), widen(b, mxu), (((contract[0],), (contract[1],)), ((), ())),
                             preferred_element_type=acc, precision=precision)


def _masked_k(x, axis: int, k_rem: int, last_k):
  """`x` with the columns (or rows) past K zeroed on the last K tile, which runs past the array's end."""
  if not k_rem:
    return x
  index = jax.lax.broadcasted_iota(jnp.int32, x.shape, axis)
  return jnp.where((index < k_rem) | jnp.logical_not(last_k), x, jnp.zeros((), x.dtype))


def _row_blocks(tm: int, sub: int) -> list[int]:
  return list(range(0, tm, sub)) if sub < tm else [0]


def footprint(tiling: Tiling, lhs_dtype, rhs_dtype, out_dtype) -> int:
  """VMEM bytes of a gmm's double-buffered tiles, its accumulator and the widened copies of narrower operand tiles
  (tgmm's is no larger at the same tiling)."""
  tm, tk, tn = tiling.tm, tiling.tk, tiling.tn
  size = lambda d: int(jnp.dtype(d).itemsize)  # pylint: disable=unnecessary-lambda-assignment
  wide = size(mxu_dtype(lhs_dtype, rhs_dtype))
  widened = sum(n * wide for n, d in ((tm * tk, lhs_dtype), (tk * tn, rhs_dtype)) if size(d) < wide)
  return 2 * (tm * tk * size(lhs_dtype) + tk * tn * size(rhs_dtype) + tm * tn * size(out_dtype)) + tm * tn * 4 + widened


def _vmem_limit(*tiles: tuple[tuple[int, ...], object]) -> int:
  """VMEM for double-buffered tiles (shape, dtype) plus the accumulator's margin, within the target chip's."""
  need = sum(2 * int(jnp.dtype(d).itemsize) * functools.reduce(lambda a, b: a * b, s, 1) for s, d in tiles)
  return int(min(VMEM_CAP, target.vmem_bytes(), max(32 * 2**20, need * 3 // 2 + 8 * 2**20)))


@functools.partial(jax.jit, static_argnames=("out_dtype", "tiling", "transpose_rhs", "sub_rows", "interpret",
                                             "zero_tail"))
def gmm(lhs, rhs, group_sizes, row_scale=None, col_scale=None, *, out_dtype=jnp.float32, tiling=Tiling(),
        transpose_rhs: bool = False, sub_rows: int = SUB_ROWS, interpret: bool = False, zero_tail: bool = False):
  """`lhs[r] @ rhs[g(r)]` ([M, K] x [G, K, N] -> [M, N]; rhs [G, N, K] with transpose_rhs), times `row_scale[r]` and
  `col_scale[n]` when given, rounded once to `out_dtype`. M must be a multiple of `tiling.tm` (pad the rows); rows
  past sum(group_sizes) are zeros with `zero_tail` (the kernel stores them: no pass of the caller's over the
  output), else undefined."""
  m, k = lhs.shape
  n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  tm, tk, tn = tiling.tm, tiling.tk, tiling.tn
  if m % tm:
    raise ValueError(f"gmm rows {m} are not a multiple of the row tile {tm}; pad them")
  sub = sub_rows if tm % sub_rows == 0 else tm
  mxu = mxu_dtype(lhs.dtype, rhs.dtype)
  tiles_k, k_rem = -(-k // tk), k % tk
  meta, count = visits(group_sizes, m // tm, tm, visit_empty=False)
  meta, count = tail_visits(meta, count, m // tm, tm) if zero_tail else (meta + (jnp.zeros_like(meta[1]),), count)
  scaled = (row_scale is not None, col_scale is not None)

  def kernel(offsets, group_of, tile_of, tail, lhs_ref, rhs_ref, *rest):
    rest = list(rest)
    row_scale_ref = rest.pop(0) if scaled[0] else None
    col_scale_ref = rest.pop(0) if scaled[1] else None
    out_ref, acc_ref = rest
    visit, k_i = pl.program_id(1), pl.program_id(2)
    group = group_of[visit]
    start, end = offsets[group], offsets[group + 1]
    row0 = tile_of[visit] * tm
    last_k = k_i == tiles_k - 1
    is_tail = tail[visit] > 0
    full = (start <= row0) & (end >= row0 + tm) & jnp.logical_not(is_tail)

    @pl.when(is_tail & last_k)
    def _zeros_past_the_groups():  # this tile's rows of groups (a visit just before) kept, the rest zero
      rows = row0 + jax.lax.broadcasted_iota(jnp.int32, (tm, tn), 0)
      out_ref[...] = jnp.where(rows < offsets[offsets.shape[0] - 1], out_ref[...], jnp.zeros((), out_ref.dtype))

    @pl.when(k_i == 0)
    def _zero():
      acc_ref[...] = jnp.zeros_like(acc_ref)

    def accumulate(lo: int, rows: int):
      a = _masked_k(widen(lhs_ref[pl.ds(lo, rows), :], mxu), 1, k_rem, last_k)
      b = _masked_k(widen(rhs_ref[...], mxu), 1 if transpose_rhs else 0, k_rem, last_k)
      acc_ref[pl.ds(lo, rows), :] += _product(a, b, (1, 1 if transpose_rhs else 0), mxu)

    @pl.when(full)
    def _whole_tile():
      accumulate(0, tm)

    @pl.when(jnp.logical_not(full) & jnp.logical_not(is_tail))
    def _group_s_blocks():
      for lo in _row_blocks(tm, sub):
        @pl.when((row0 + lo < end) & (row0 + lo + sub > start))
        def _block(lo=lo):
          accumulate(lo, min(sub, tm))

    @pl.when(last_k & jnp.logical_not(is_tail))
    def _store():
      acc = acc_ref[...].astype(jnp.float32)
      if row_scale_ref is not None:
        acc = acc * row_scale_ref[...]
      if col_scale_ref is not None:
        acc = acc * col_scale_ref[...]

      @pl.when(full)
      def _all_rows():
        out_ref[...] = acc.astype(out_ref.dtype)

      @pl.when(jnp.logical_not(full))
      def _group_s_rows():
        rows = row0 + jax.lax.broadcasted_iota(jnp.int32, (tm, tn), 0)
        mine = (rows >= start) & (rows < end)
        out_ref[...] = jnp.where(mine, acc, out_ref[...].astype(jnp.float32)).astype(out_ref.dtype)

  def read_tile(v, tile_of, tail):  # a tail visit reads the blocks the visit before it read: no copy
    return jnp.where(tail[v] > 0, tail[v] - 1, tile_of[v])

  def read_k(v, k_i, tail):
    return jnp.where(tail[v] > 0, tiles_k - 1, k_i)

  in_specs = [pl.BlockSpec((tm, tk), lambda n_i, v, k_i, offsets, group_of, tile_of, tail:
                           (read_tile(v, tile_of, tail), read_k(v, k_i, tail)))]
  if transpose_rhs:
    in_specs.append(pl.BlockSpec((None, tn, tk), lambda n_i, v, k_i, offsets, group_of, tile_of, tail:
                                 (group_of[v], n_i, read_k(v, k_i, tail))))
  else:
    in_specs.append(pl.BlockSpec((None, tk, tn), lambda n_i, v, k_i, offsets, group_of, tile_of, tail:
                                 (group_of[v], read_k(v, k_i, tail), n_i)))
  operands = [lhs, rhs]
  if scaled[0]:
    in_specs.append(pl.BlockSpec((tm, 1), lambda n_i, v, k_i, offsets, group_of, tile_of, tail:
                                 (read_tile(v, tile_of, tail), 0)))
    operands.append(row_scale.astype(jnp.float32).reshape(m, 1))
  if scaled[1]:
    in_specs.append(pl.BlockSpec((1, tn), lambda n_i, v, k_i, offsets, group_of, tile_of, tail: (0, n_i)))
    operands.append(col_scale.astype(jnp.float32).reshape(1, n))
  acc_dtype = jnp.int32 if mxu == jnp.int8 else jnp.float32
  out_dtype = jnp.dtype(out_dtype)
  call = pl.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct((m, n), out_dtype),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=4, grid=(-(-n // tn), count, tiles_k), in_specs=in_specs,
          out_specs=pl.BlockSpec((tm, tn), lambda n_i, v, k_i, offsets, group_of, tile_of, tail: (tile_of[v], n_i)),
          scratch_shapes=[pltpu.VMEM((tm, tn), acc_dtype)]),
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "arbitrary", "arbitrary"),
          vmem_limit_bytes=_vmem_limit(((tm, tk), lhs.dtype), ((tk, tn), rhs.dtype), ((tm, tn), out_dtype),
                                       ((tm, tn // 2), acc_dtype))),
      cost_estimate=pl.CostEstimate(flops=2 * m * k * n, transcendentals=0,
                                    bytes_accessed=lhs.size * lhs.dtype.itemsize * -(-n // tn)
                                    + rhs.size * rhs.dtype.itemsize + m * n * out_dtype.itemsize),
      interpret=interpret,
  )
  return call(*meta, *operands)


@functools.partial(jax.jit, static_argnames=("out_dtype", "tiling", "sub_rows", "interpret"))
def tgmm(lhs, grad, group_sizes, col_scale=None, *, out_dtype=jnp.float32, tiling=Tiling(),
         sub_rows: int = SUB_ROWS, interpret: bool = False):
  """Per group `lhs[rows of g]^T @ grad[rows of g]` ([M, K], [M, N] -> [G, K, N], zero for an empty group), times
  `col_scale[n]` when given, rounded once to `out_dtype`. M must be a multiple of `tiling.tm`."""
  m, k = lhs.shape
  n = grad.shape[1]
  g = group_sizes.shape[0]
  tm, tk, tn = tiling.tm, tiling.tk, tiling.tn
  if m % tm:
    raise ValueError(f"tgmm rows {m} are not a multiple of the row tile {tm}; pad them")
  sub = sub_rows if tm % sub_rows == 0 else tm
  mxu = mxu_dtype(lhs.dtype, grad.dtype)
  meta, count = visits(group_sizes, m // tm, tm, visit_empty=True)
  scaled = col_scale is not None

  def kernel(offsets, group_of, tile_of, lhs_ref, grad_ref, *rest):
    rest = list(rest)
    col_scale_ref = rest.pop(0) if scaled else None
    out_ref, acc_ref = rest
    visit, visits_n = pl.program_id(2), pl.num_programs(2)
    group = group_of[visit]
    start, end = offsets[group], offsets[group + 1]
    row0 = tile_of[visit] * tm
    full = (start <= row0) & (end >= row0 + tm)
    first = (visit == 0) | (group_of[jnp.maximum(visit - 1, 0)] != group)
    last = (visit == visits_n - 1) | (group_of[jnp.minimum(visit + 1, visits_n - 1)] != group)

    @pl.when(first)
    def _zero():
      acc_ref[...] = jnp.zeros_like(acc_ref)

    def accumulate(lo: int, rows: int, masked: bool):
      a, b = lhs_ref[pl.ds(lo, rows), :], grad_ref[pl.ds(lo, rows), :]
      if masked:
        index = row0 + lo + jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0)
        mine = (index >= start) & (index < end)
        a = jnp.where(mine, widen(a, mxu), jnp.zeros((), mxu))
        b = jnp.where(mine, widen(b, mxu), jnp.zeros((), mxu))
      acc_ref[...] += _product(a, b, (0, 0), mxu)

    @pl.when(full)
    def _whole_tile():
      accumulate(0, tm, False)

    @pl.when(jnp.logical_not(full) & (end > start))
    def _group_s_blocks():
      for lo in _row_blocks(tm, sub):
        @pl.when((row0 + lo < end) & (row0 + lo + sub > start))
        def _block(lo=lo):
          accumulate(lo, min(sub, tm), True)

    @pl.when(last)
    def _store():
      acc = acc_ref[...].astype(jnp.float32)
      if col_scale_ref is not None:
        acc = acc * col_scale_ref[...]
      out_ref[...] = acc.astype(out_ref.dtype)

  in_specs = [pl.BlockSpec((tm, tk), lambda n_i, k_i, v, offsets, group_of, tile_of: (tile_of[v], k_i)),
              pl.BlockSpec((tm, tn), lambda n_i, k_i, v, offsets, group_of, tile_of: (tile_of[v], n_i))]
  operands = [lhs, grad]
  if scaled:
    in_specs.append(pl.BlockSpec((1, tn), lambda n_i, k_i, v, offsets, group_of, tile_of: (0, n_i)))
    operands.append(col_scale.astype(jnp.float32).reshape(1, n))
  acc_dtype = jnp.int32 if mxu == jnp.int8 else jnp.float32
  out_dtype = jnp.dtype(out_dtype)
  call = pl.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct((g, k, n), out_dtype),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=3, grid=(-(-n // tn), -(-k // tk), count), in_specs=in_specs,
          out_specs=pl.BlockSpec((None, tk, tn), lambda n_i, k_i, v, offsets, group_of, tile_of:
                                 (group_of[v], k_i, n_i)),
          scratch_shapes=[pltpu.VMEM((tk, tn), acc_dtype)]),
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "arbitrary", "arbitrary"),
          vmem_limit_bytes=_vmem_limit(((tm, tk), lhs.dtype), ((tm, tn), grad.dtype), ((tk, tn), out_dtype),
                                       ((tk, tn // 2), acc_dtype))),
      cost_estimate=pl.CostEstimate(flops=2 * m * k * n, transcendentals=0,
                                    bytes_accessed=lhs.size * lhs.dtype.itemsize * -(-n // tn)
                                    + grad.size * grad.dtype.itemsize * -(-k // tk) + g * k * n * out_dtype.itemsize),
      interpret=interpret,
  )
  return call(*meta, *operands)
