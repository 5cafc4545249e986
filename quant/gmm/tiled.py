"""The reference grouped matmul: Megablox-style work items on row tiles, built from `jax.lax.dot_general`.

A work item is a (row tile, group) pair that overlaps: at most M/tile + G - 1 of them, so the work is
O((M/tile + G) * tile * K * N) instead of the O(G * M * K * N) of `jax.lax.ragged_dot`'s CPU lowering. The
items run as a loop of tile matmuls ("loop", no extra memory) or as one batched matmul ("batched", gathers a
[K, N] weight copy per item: small weights only). Runs anywhere; the default kernel on CPU.
"""

import jax
import jax.numpy as jnp

STRATEGIES = ("loop", "batched")



def _work_items(group_sizes, m: int, tile: int):
  """(tile, group) pairs that overlap, padded to the static bound num_tiles + G - 1; both indices nondecreasing.

  Returns (item_tile, item_group, row_lo, row_hi): rows [row_lo, row_hi) of the item's tile belong to its group
  (an empty range for padding items).
  """
  num_tiles, num_groups = -(-m // tile), group_sizes.shape[0]
  ends = jnp.clip(jnp.cumsum(group_sizes), 0, m)
  starts = jnp.clip(ends - group_sizes, 0, m)
  first = starts // tile
  count = jnp.where(ends > starts, -(-ends // tile) - first, 0)
  count_end = jnp.cumsum(count)
  items = jnp.arange(num_tiles + num_groups - 1, dtype=jnp.int32)
  group = jnp.minimum(jnp.searchsorted(count_end, items, side="right"), num_groups - 1).astype(jnp.int32)
  valid = items < count_end[-1]
  tile_idx = first[group] + items - (count_end[group] - count[group])
  tile_idx = jnp.where(valid, jnp.clip(tile_idx, 0, num_tiles - 1), num_tiles - 1).astype(jnp.int32)
  row_lo = jnp.where(valid, starts[group], 0)
  row_hi = jnp.where(valid, ends[group], 0)
  return tile_idx, group, row_lo, row_hi


def _tiles(x, tile: int):
  """[M, D] -> [num_tiles, tile, D] (zero padded)."""
  pad = -(-x.shape[0] // tile) * tile - x.shape[0]
  return jnp.pad(x, ((0, pad), (0, 0))).reshape(-1, tile, x.shape[1])


def _item_row_mask(tile_idx, row_lo, row_hi, tile: int):
  rows = tile_idx[:, None] * tile + jnp.arange(tile, dtype=jnp.int32)[None, :]
  return (rows >= row_lo[:, None]) & (rows < row_hi[:, None])  # [W, tile]


def matmul(lhs, rhs, group_sizes, *, tile: int, strategy: str, compute_dtype, transpose_rhs: bool = False):
  """float32 `lhs[r] @ rhs[g(r)]` (`@ rhs[g(r)].T` if transpose_rhs) for rhs [G,K,N]; rows outside groups give 0.

  Operands are cast to `compute_dtype` tile by tile (fp8 values are exact in float32 and so are their products).
  """
  m, n = lhs.shape[0], rhs.shape[1 if transpose_rhs else 2]
  tile_idx, group, row_lo, row_hi = _work_items(group_sizes, m, tile)
  lhs_tiles = _tiles(lhs, tile)
  rhs_contract = 1 if transpose_rhs else 0  # axis of one expert's [K, N] weight
  if strategy == "batched":  # one batched matmul over all work items (gathers a weight copy per item)
    batched = (((2,), (rhs_contract + 1,)), ((0,), (0,)))
    y = jax.lax.dot_general(lhs_tiles[tile_idx].astype(compute_dtype), rhs[group].astype(compute_dtype), batched,
                            preferred_element_type=jnp.float32,
                            precision=_precision(compute_dtype))
    y = jnp.where(_item_row_mask(tile_idx, row_lo, row_hi, tile)[:, :, None], y, 0.0)
    out = jax.ops.segment_sum(y, tile_idx, num_segments=lhs_tiles.shape[0], indices_are_sorted=True)
    return out.reshape(-1, n)[:m]

  def body(i, out):  # one work item per iteration, accumulated into its output tile
    y = jax.lax.dot_general(lhs_tiles[tile_idx[i]].astype(compute_dtype), rhs[group[i]].astype(compute_dtype),
                            (((1,), (rhs_contract,)), ((), ())), preferred_element_type=jnp.float32,
                            precision=_precision(compute_dtype))
    mask = _item_row_mask(tile_idx[i, None], row_lo[i, None], row_hi[i, None], tile)[0]
    return out.at[tile_idx[i]].add(jnp.where(mask[:, None], y, 0.0))

  out = jnp.zeros((lhs_tiles.shape[0], tile, n), jnp.float32)
  out = jax.lax.fori_loop(0, _num_valid_items(group_sizes, m, tile), body, out)
  return out.reshape(-1, n)[:m]


def outer(lhs, grad, group_sizes, *, tile: int, strategy: str, compute_dtype):
  """float32 `sum over rows r of group g: lhs[r]^T grad[r]` -> [G, K, N] (empty groups give 0)."""
  m, num_groups = lhs.shape[0], group_sizes.shape[0]
  tile_idx, group, row_lo, row_hi = _work_items(group_sizes, m, tile)
  lhs_tiles, grad_tiles = _tiles(lhs, tile), _tiles(grad, tile)
  if strategy == "batched":
    mask = _item_row_mask(tile_idx, row_lo, row_hi, tile)[:, :, None]
    x = jnp.where(mask, lhs_tiles[tile_idx].astype(compute_dtype), 0)  # [W, tile, K]
    g = jnp.where(mask, grad_tiles[tile_idx].astype(compute_dtype), 0)  # [W, tile, N]
    p = jax.lax.dot_general(x, g, (((1,), (1,)), ((0,), (0,))), preferred_element_type=jnp.float32,
                            precision=_precision(compute_dtype))
    return jax.ops.segment_sum(p, group, num_segments=num_groups, indices_are_sorted=True)

  def body(i, out):
    mask = _item_row_mask(tile_idx[i, None], row_lo[i, None], row_hi[i, None], tile)[0][:, None]
    x = jnp.where(mask, lhs_tiles[tile_idx[i]].astype(compute_dtype), 0)
    g = jnp.where(mask, grad_tiles[tile_idx[i]].astype(compute_dtype), 0)
    p = jax.lax.dot_general(x, g, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32,
                            precision=_precision(compute_dtype))
    return out.at[group[i]].add(p)

  out = jnp.zeros((num_groups, lhs.shape[1], grad.shape[1]), jnp.float32)
  return jax.lax.fori_loop(0, _num_valid_items(group_sizes, m, tile), body, out)


def _precision(compute_dtype):
  """HIGHEST for float32 products (every bit of them, on an accelerator too), the default for narrower ones."""
  return jax.lax.Precision.HIGHEST if jnp.dtype(compute_dtype) == jnp.float32 else jax.lax.Precision.DEFAULT


def _num_valid_items(group_sizes, m: int, tile: int):
  ends = jnp.clip(jnp.cumsum(group_sizes), 0, m)
  starts = jnp.clip(ends - group_sizes, 0, m)
  return jnp.sum(jnp.where(ends > starts, -(-ends // tile) - starts // tile, 0)).astype(jnp.int32)
