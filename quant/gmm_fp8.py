"""FP8 grouped matmul of row-sorted tokens with a quantizing backward pass (MaxText Megablox granularity).

`quantized_gmm(lhs[M,K], rhs[G,K,N], group_sizes[G], rule)` computes `out[r] = lhs[r] @ rhs[g(r)]` where rows
are grouped consecutively (`group_sizes[0]` rows use expert 0, ...); rows past `sum(group_sizes)` give zeros.
With a `qwix.QtRule` whose `weight_qtype` is set it reproduces MaxText's quantized `gmm`:

* forward: lhs quantized to `act_qtype` per row (scale [M,1]; skipped when `act_qtype` is None), rhs to
  `weight_qtype` per output column shared by all experts (scale [1,1,N]); `disable_channelwise_axes` makes both
  per-tensor. The grouped matmul runs on the fp8 values cast to float32 (exact products, float32 accumulation)
  and is then rescaled by `lhs_scale[row] * rhs_scale[col]`.
* backward (custom VJP, straight-through): the forward's quantized operands are the residuals. dlhs uses
  `g * rhs_scale[col]` quantized to `bwd_qtype` per row against the fp8 rhs; drhs uses `g * lhs_scale[row]`
  quantized per column against the fp8 lhs, summed per group. `bwd_qtype` None leaves the gradient unquantized.
  Calibrations come from the rule (`act_/weight_/bwd_calibration_method`); group_sizes get no cotangent.

Without a quantizing rule (None, or `weight_qtype` None) it is a plain grouped matmul in both directions.

The grouped matmul is built from `jax.lax.dot_general` on row tiles (Megablox-style work items: every
(tile, group) pair that overlaps, at most M/tile + G - 1), O((M/tile + G) * tile * K * N) work instead of the
O(G * M * K * N) of `jax.lax.ragged_dot`'s CPU lowering; the items run as a loop of tile matmuls (default) or
as one batched matmul (strategy="batched", for small weights). Everything here runs with Qwix interception
disabled, so under a `QtProvider` none of its internal ops is intercepted, quantized again or logged as a module op.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import qwix
from qwix._src import interception  # the mechanism Qwix's own handlers use to avoid recursion

from quant import errors
from quant import fp8

DEFAULT_TILE_ROWS = 128
STRATEGIES = ("loop", "batched")


@dataclasses.dataclass(frozen=True)
class GmmQuantConfig:
  """What a rule quantizes in the grouped matmul (hashable; qtypes are dtype names or None)."""

  weight_qtype: str
  act_qtype: str | None = None
  bwd_qtype: str | None = None
  weight_calibration: str = "absmax"
  act_calibration: str = "absmax"
  bwd_calibration: str = "absmax"
  channelwise: bool = True


def config_from_rule(rule) -> GmmQuantConfig | None:
  """Returns the grouped-matmul quantization of a `qwix.QtRule`, or None if it does not quantize weights."""
  if rule is None or getattr(rule, "weight_qtype", None) is None:
    return None
  if not isinstance(rule, qwix.QtRule):
    raise errors.QuantError(
        f"grouped matmul quantization needs a qwix.QtRule, got {type(rule).__name__}; accepted: qwix.QtRule or None")

  def name(qtype):
    return None if qtype is None else fp8.resolve_qtype(qtype).name

  def calibration(method):
    method = method or "absmax"
    fp8.parse_calibration(method)
    return method

  return GmmQuantConfig(
      weight_qtype=name(rule.weight_qtype),
      act_qtype=name(rule.act_qtype),
      bwd_qtype=name(rule.bwd_qtype),
      weight_calibration=calibration(rule.weight_calibration_method),
      act_calibration=calibration(rule.act_calibration_method),
      bwd_calibration=calibration(rule.bwd_calibration_method),
      channelwise=not rule.disable_channelwise_axes,
  )


@dataclasses.dataclass(frozen=True)
class _Spec:
  """Static (non-differentiable) arguments of the custom VJP."""

  config: GmmQuantConfig | None
  out_dtype: str
  lhs_dtype: str
  rhs_dtype: str
  tile_rows: int
  strategy: str


def quantized_gmm(lhs, rhs, group_sizes, rule, preferred_element_type=None, *, tile_rows=None, strategy=None):
  """Grouped matmul `[M,K] x [G,K,N] -> [M,N]` of row-sorted tokens, FP8-quantized per `rule`.

  Args:
    lhs: [M, K] floating rows sorted by group.
    rhs: [G, K, N] floating per-group weights.
    group_sizes: [G] integer row counts (sum <= M; later rows give zeros).
    rule: a `qwix.QtRule` (quantizes when `weight_qtype` is set) or None (plain grouped matmul).
    preferred_element_type: output dtype (default: the promoted dtype of lhs and rhs).
    tile_rows: rows per work tile (default: DEFAULT_TILE_ROWS, capped by M rounded up to 8).
    strategy: "loop" (default: one tile matmul per work item in a loop, no extra memory) or "batched" (one
      batched matmul over all work items; gathers a [K, N] weight copy per item, so only for small weights).

  Returns:
    [M, N] array of `preferred_element_type`.
  """
  lhs, rhs, group_sizes = jnp.asarray(lhs), jnp.asarray(rhs), jnp.asarray(group_sizes)
  _check_shapes(lhs, rhs, group_sizes)
  out_dtype = jnp.dtype(preferred_element_type or jnp.result_type(lhs.dtype, rhs.dtype))
  spec = _Spec(config_from_rule(rule), out_dtype.name, lhs.dtype.name, rhs.dtype.name,
               _tile_rows(lhs.shape[0], tile_rows), _strategy(strategy))
  if lhs.shape[0] == 0 or rhs.shape[0] == 0:  # no rows or no groups: nothing to multiply
    return jnp.zeros((lhs.shape[0], rhs.shape[2]), out_dtype)
  return interception.disable_interceptions(_gmm_jit)(lhs, rhs, group_sizes.astype(jnp.int32), spec)


def _check_shapes(lhs, rhs, group_sizes) -> None:
  if lhs.ndim != 2 or rhs.ndim != 3 or group_sizes.ndim != 1:
    raise errors.QuantError(
        f"grouped matmul shapes lhs {lhs.shape}, rhs {rhs.shape}, group_sizes {group_sizes.shape} are invalid; "
        "accepted: lhs [M,K], rhs [G,K,N], group_sizes [G]")
  if lhs.shape[1] != rhs.shape[1] or rhs.shape[0] != group_sizes.shape[0]:
    raise errors.QuantError(
        f"grouped matmul shapes lhs {lhs.shape}, rhs {rhs.shape}, group_sizes {group_sizes.shape} do not agree; "
        "accepted: lhs [M,K], rhs [G,K,N], group_sizes [G]")
  if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
    raise errors.QuantError(f"group_sizes dtype {group_sizes.dtype} is invalid; accepted: an integer dtype")


def _strategy(strategy) -> str:
  if strategy is None:
    return "loop"
  if strategy not in STRATEGIES:
    raise errors.QuantError(f"grouped matmul strategy {strategy!r} is invalid; accepted: {', '.join(STRATEGIES)}")
  return strategy


def _tile_rows(m: int, tile_rows) -> int:
  if tile_rows is not None and (not isinstance(tile_rows, int) or tile_rows < 1):
    raise errors.QuantError(f"tile_rows {tile_rows!r} is invalid; accepted: a positive integer")
  return min(tile_rows or DEFAULT_TILE_ROWS, max(8, -(-m // 8) * 8))


# ---------------------------------------------------------------------------------------------------------------
# Plain grouped matmul on row tiles.


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


def _grouped_matmul(lhs, rhs, group_sizes, tile: int, strategy: str, compute_dtype, transpose_rhs: bool = False):
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
                            preferred_element_type=jnp.float32)
    y = jnp.where(_item_row_mask(tile_idx, row_lo, row_hi, tile)[:, :, None], y, 0.0)
    out = jax.ops.segment_sum(y, tile_idx, num_segments=lhs_tiles.shape[0], indices_are_sorted=True)
    return out.reshape(-1, n)[:m]

  def body(i, out):  # one work item per iteration, accumulated into its output tile
    y = jax.lax.dot_general(lhs_tiles[tile_idx[i]].astype(compute_dtype), rhs[group[i]].astype(compute_dtype),
                            (((1,), (rhs_contract,)), ((), ())), preferred_element_type=jnp.float32)
    mask = _item_row_mask(tile_idx[i, None], row_lo[i, None], row_hi[i, None], tile)[0]
    return out.at[tile_idx[i]].add(jnp.where(mask[:, None], y, 0.0))

  out = jnp.zeros((lhs_tiles.shape[0], tile, n), jnp.float32)
  out = jax.lax.fori_loop(0, _num_valid_items(group_sizes, m, tile), body, out)
  return out.reshape(-1, n)[:m]


def _grouped_outer(lhs, grad, group_sizes, tile: int, strategy: str, compute_dtype):
  """float32 `sum over rows r of group g: lhs[r]^T grad[r]` -> [G, K, N] (empty groups give 0)."""
  m, num_groups = lhs.shape[0], group_sizes.shape[0]
  tile_idx, group, row_lo, row_hi = _work_items(group_sizes, m, tile)
  lhs_tiles, grad_tiles = _tiles(lhs, tile), _tiles(grad, tile)
  if strategy == "batched":
    mask = _item_row_mask(tile_idx, row_lo, row_hi, tile)[:, :, None]
    x = jnp.where(mask, lhs_tiles[tile_idx].astype(compute_dtype), 0)  # [W, tile, K]
    g = jnp.where(mask, grad_tiles[tile_idx].astype(compute_dtype), 0)  # [W, tile, N]
    p = jax.lax.dot_general(x, g, (((1,), (1,)), ((0,), (0,))), preferred_element_type=jnp.float32)
    return jax.ops.segment_sum(p, group, num_segments=num_groups, indices_are_sorted=True)

  def body(i, out):
    mask = _item_row_mask(tile_idx[i, None], row_lo[i, None], row_hi[i, None], tile)[0][:, None]
    x = jnp.where(mask, lhs_tiles[tile_idx[i]].astype(compute_dtype), 0)
    g = jnp.where(mask, grad_tiles[tile_idx[i]].astype(compute_dtype), 0)
    p = jax.lax.dot_general(x, g, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    return out.at[group[i]].add(p)

  out = jnp.zeros((num_groups, lhs.shape[1], grad.shape[1]), jnp.float32)
  return jax.lax.fori_loop(0, _num_valid_items(group_sizes, m, tile), body, out)


def _num_valid_items(group_sizes, m: int, tile: int):
  ends = jnp.clip(jnp.cumsum(group_sizes), 0, m)
  starts = jnp.clip(ends - group_sizes, 0, m)
  return jnp.sum(jnp.where(ends > starts, -(-ends // tile) - starts // tile, 0)).astype(jnp.int32)


def _rows_in_groups(group_sizes, m: int):
  return (jnp.arange(m) < jnp.sum(group_sizes))[:, None]


# ---------------------------------------------------------------------------------------------------------------
# Custom VJP.


def _quantize(x, qtype, axis: int, calibration: str, channelwise: bool):
  return fp8.quantize(x, qtype, [axis] if channelwise else [], calibration, scale_dtype=jnp.float32)


def _fwd(lhs, rhs, group_sizes, spec: _Spec):
  cfg, tile, how = spec.config, spec.tile_rows, spec.strategy
  if cfg is None:
    out = _grouped_matmul(lhs, rhs, group_sizes, tile, how, jnp.result_type(lhs, rhs))
    return out.astype(spec.out_dtype), (lhs, None, rhs, None, group_sizes)
  rhs, rhs_scale = _quantize(rhs, cfg.weight_qtype, 2, cfg.weight_calibration, cfg.channelwise)  # [1, 1, N|1]
  out, lhs, lhs_scale = _fwd_quantized_rhs(lhs, rhs, rhs_scale, group_sizes, spec)
  return out, (lhs, lhs_scale, rhs, rhs_scale, group_sizes)


def _fwd_quantized_rhs(lhs, rhs, rhs_scale, group_sizes, spec: _Spec):
  """Forward on an fp8 rhs with its float32 scale [1, 1, N|1]: (output, quantized lhs, lhs scale or None)."""
  cfg, tile, how = spec.config, spec.tile_rows, spec.strategy
  lhs_scale = None
  if cfg.act_qtype is not None:
    lhs, lhs_scale = _quantize(lhs, cfg.act_qtype, 0, cfg.act_calibration, cfg.channelwise)  # scale [M|1, 1]
  acc = _grouped_matmul(lhs, rhs, group_sizes, tile, how, jnp.float32)
  if lhs_scale is not None:
    acc = acc * lhs_scale
  acc = acc * rhs_scale.reshape(1, -1)
  acc = jnp.where(_rows_in_groups(group_sizes, acc.shape[0]), acc, 0.0)
  return acc.astype(spec.out_dtype), lhs, lhs_scale


def _bwd(spec: _Spec, residuals, grad):
  lhs, lhs_scale, rhs, rhs_scale, group_sizes = residuals
  cfg, tile, how = spec.config, spec.tile_rows, spec.strategy
  in_groups = _rows_in_groups(group_sizes, grad.shape[0])
  grad = jnp.where(in_groups, grad, jnp.zeros_like(grad))  # outputs past the groups are constant zeros
  if cfg is None:
    dlhs = _grouped_matmul(grad, rhs, group_sizes, tile, how, jnp.result_type(grad, rhs), transpose_rhs=True)
    drhs = _grouped_outer(lhs, grad, group_sizes, tile, how, jnp.result_type(lhs, grad))
    return dlhs.astype(spec.lhs_dtype), drhs.astype(spec.rhs_dtype), None

  # dlhs = (g * rhs_scale) @ rhs_q^T: the weight scale moves onto the gradient so the fp8 rhs is reused.
  dlhs_dout = grad * rhs_scale.astype(grad.dtype).reshape(1, -1)
  dlhs_scale = None
  if cfg.bwd_qtype is not None:
    dlhs_dout, dlhs_scale = _quantize(dlhs_dout, cfg.bwd_qtype, 0, cfg.bwd_calibration, cfg.channelwise)
  dlhs = _grouped_matmul(dlhs_dout, rhs, group_sizes, tile, how, jnp.float32, transpose_rhs=True)
  if dlhs_scale is not None:
    dlhs = dlhs * dlhs_scale
  dlhs = jnp.where(in_groups, dlhs, 0.0)

  # drhs[g] = lhs_q[rows of g]^T @ (g * lhs_scale), the gradient quantized per output column.
  drhs_dout = grad if lhs_scale is None else jnp.where(in_groups, grad * lhs_scale.astype(grad.dtype), 0)
  drhs_scale = None
  if cfg.bwd_qtype is not None:
    drhs_dout, drhs_scale = _quantize(drhs_dout, cfg.bwd_qtype, 1, cfg.bwd_calibration, cfg.channelwise)
  drhs = _grouped_outer(lhs, drhs_dout, group_sizes, tile, how, jnp.float32)
  if drhs_scale is not None:
    drhs = drhs * drhs_scale.reshape(1, 1, -1)
  return dlhs.astype(spec.lhs_dtype), drhs.astype(spec.rhs_dtype), None


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _gmm_vjp(lhs, rhs, group_sizes, spec):
  return _fwd(lhs, rhs, group_sizes, spec)[0]


_gmm_vjp.defvjp(interception.disable_interceptions(_fwd), interception.disable_interceptions(_bwd))
_gmm_jit = jax.jit(_gmm_vjp, static_argnums=(3,))  # one compilation per shape and spec when called eagerly


def prequantized_gmm(lhs, rhs_qvalue, rhs_scale, group_sizes, rule, preferred_element_type=None, *, tile_rows=None,
                     strategy=None):
  """Forward-only FP8 grouped matmul with a weight quantized ahead of time (e.g. loaded from an FP8 export).

  Computes what `quantized_gmm` computes when its on-the-fly weight quantization gives `rhs_qvalue` and
  `rhs_scale`: activations are quantized per `rule` (act_qtype, per row), the weight is used as stored.

  Args:
    lhs: [M, K] floating rows sorted by group.
    rhs_qvalue: [G, K, N] fp8 weight values.
    rhs_scale: the weight's scale, one per output column shared by the groups ([1, 1, N]) or one in all.
    group_sizes: [G] integer row counts.
    rule: a `qwix.QtRule` that quantizes weights (its act_qtype and calibrations apply).
    preferred_element_type: output dtype (default: lhs's dtype).
    tile_rows, strategy: as for `quantized_gmm`.
  """
  lhs, rhs_qvalue, group_sizes = jnp.asarray(lhs), jnp.asarray(rhs_qvalue), jnp.asarray(group_sizes)
  _check_shapes(lhs, rhs_qvalue, group_sizes)
  cfg = config_from_rule(rule)
  if cfg is None:
    raise errors.QuantError("a pre-quantized grouped-matmul weight needs a rule that quantizes weights; "
                            "accepted: a qwix.QtRule with weight_qtype set")
  scale = jnp.asarray(rhs_scale, jnp.float32)
  if scale.size not in (1, rhs_qvalue.shape[2]):
    raise errors.QuantError(f"grouped matmul weight scale of shape {scale.shape} does not fit a weight of shape "
                            f"{rhs_qvalue.shape}; accepted: [1, 1, N] or one scale")
  out_dtype = jnp.dtype(preferred_element_type or lhs.dtype)
  spec = _Spec(cfg, out_dtype.name, lhs.dtype.name, rhs_qvalue.dtype.name, _tile_rows(lhs.shape[0], tile_rows),
               _strategy(strategy))
  if lhs.shape[0] == 0 or rhs_qvalue.shape[0] == 0:
    return jnp.zeros((lhs.shape[0], rhs_qvalue.shape[2]), out_dtype)
  return interception.disable_interceptions(_prequantized_jit)(lhs, rhs_qvalue, scale.reshape(1, 1, -1),
                                                               group_sizes.astype(jnp.int32), spec)


@functools.partial(jax.jit, static_argnums=(4,))
def _prequantized_jit(lhs, rhs_qvalue, rhs_scale, group_sizes, spec):
  return _fwd_quantized_rhs(lhs, rhs_qvalue, rhs_scale, group_sizes, spec)[0]
