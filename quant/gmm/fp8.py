"""FP8 grouped matmul of row-sorted tokens with a quantizing backward pass (MaxText Megablox granularity).

`quantized_gmm(lhs[M,K], rhs[G,K,N], group_sizes[G], rule)` computes `out[r] = lhs[r] @ rhs[g(r)]` where rows
are grouped consecutively (`group_sizes[0]` rows use expert 0, ...); rows past `sum(group_sizes)` give zeros.
With a `qwix.QtRule` it quantizes what the rule names, as MaxText's Megablox `gmm` does:

* forward: lhs to `act_qtype` per row (scale [M,1]), rhs to `weight_qtype` per output column shared by all
  experts (scale [1,1,N]); each only when its qtype is set; `disable_channelwise_axes` makes both per-tensor.
  The grouped matmul runs on the fp8 values (exact products, float32 accumulation) and is then rescaled by
  `lhs_scale[row] * rhs_scale[col]`. Under an `act_tiles.ActTileRule` the rows are quantized per tile of 128
  columns instead (DeepSeek's serving numerics) and enter the matmul dequantized.
* backward (custom VJP, straight-through): the forward's (quantized) operands are the residuals. dlhs uses
  `g * rhs_scale[col]` quantized to `bwd_qtype` per row against the fp8 rhs; drhs uses `g * lhs_scale[row]`
  quantized per column against the fp8 lhs, summed per group. `bwd_qtype` None leaves the gradient unquantized.
  Calibrations come from the rule (`act_/weight_/bwd_calibration_method`); group_sizes get no cotangent.

Without a rule, or with a rule that sets none of the three qtypes, it is a plain grouped matmul both ways.

The matmuls themselves run on the kernel `backend` names (`quant.gmm.backends`: the tiled reference, Pallas
Megablox, XLA's or Tokamax's ragged_dot); quantization, scaling and masking are done here, once for all.
Everything runs with Qwix interception disabled, so under a `QtProvider` none of its internal ops is
intercepted, quantized again or logged as a module op.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import qwix

from quant import act_tiles
from quant import calibration as calibration_lib
from quant import compat
from quant import errors
from quant import fp8
from quant.gmm import backends as gmm_backends
from quant.gmm import tiled as gmm_tiled
from quant.gmm import tiles as tiles_lib

DEFAULT_TILE_ROWS = 128
STRATEGIES = gmm_tiled.STRATEGIES


@dataclasses.dataclass(frozen=True)
class GmmQuantConfig:
  """What a rule quantizes in the grouped matmul (hashable; qtypes are dtype names or None)."""

  weight_qtype: str | None = None
  act_qtype: str | None = None
  bwd_qtype: str | None = None
  weight_calibration: str = "absmax"
  act_calibration: str = "absmax"
  bwd_calibration: str = "absmax"
  channelwise: bool = True
  act_tile: int | None = None  # activations quantized in tiles of this many columns (`quant.act_tiles`), fake


def config_from_rule(rule) -> GmmQuantConfig | None:
  """Returns the grouped-matmul quantization of a `qwix.QtRule`, or None if it quantizes nothing.

  Each of weight_qtype, act_qtype and bwd_qtype applies on its own, as in MaxText's Megablox gmm.
  """
  if rule is None or all(getattr(rule, f, None) is None for f in ("weight_qtype", "act_qtype", "bwd_qtype")):
    return None
  tiled = act_tiles.act_tile(rule)
  if not isinstance(rule, qwix.QtRule):
    raise errors.QuantError(
        f"grouped matmul quantization needs a qwix.QtRule, got {type(rule).__name__}; accepted: qwix.QtRule or None")

  def name(qtype):
    return None if qtype is None else fp8.resolve_qtype(qtype).name

  def calibration(method):
    method = method or "absmax"
    calibration_lib.parse_calibration(method)
    return method

  return GmmQuantConfig(
      weight_qtype=name(rule.weight_qtype),
      act_qtype=name(rule.act_qtype),
      bwd_qtype=name(rule.bwd_qtype),
      weight_calibration=calibration(rule.weight_calibration_method),
      act_calibration=calibration(rule.act_calibration_method),
      bwd_calibration=calibration(rule.bwd_calibration_method),
      channelwise=not rule.disable_channelwise_axes,
      act_tile=None if tiled is None else tiled[1],
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
  backend: str = "reference"
  tiles: tiles_lib.Tiles = tiles_lib.Tiles()


def quantized_gmm(lhs, rhs, group_sizes, rule, preferred_element_type=None, *, tile_rows=None, strategy=None,
                  backend="reference", tiles: tiles_lib.Tiles | None = None):
  """Grouped matmul `[M,K] x [G,K,N] -> [M,N]` of row-sorted tokens, FP8-quantized per `rule`.

  Args:
    lhs: [M, K] floating rows sorted by group.
    rhs: [G, K, N] floating per-group weights.
    group_sizes: [G] integer row counts (sum <= M; later rows give zeros).
    rule: a `qwix.QtRule` (quantizes what its weight_/act_/bwd_qtype name) or None (plain grouped matmul).
    preferred_element_type: output dtype (default: the promoted dtype of lhs and rhs).
    tile_rows: rows per work tile (default: DEFAULT_TILE_ROWS, capped by M rounded up to 8).
    strategy: "loop" (default: one tile matmul per work item in a loop, no extra memory) or "batched" (one
      batched matmul over all work items; gathers a [K, N] weight copy per item, so only for small weights).
    backend: the kernel (`quant.gmm.backends.KERNELS`; resolve "auto" with `gmm_backends.resolve`).
    tiles: the Pallas kernels' tilings of the forward and the two gradients (default: `tiles.Tiles()`).

  Returns:
    [M, N] array of `preferred_element_type`.
  """
  lhs, rhs, group_sizes = jnp.asarray(lhs), jnp.asarray(rhs), jnp.asarray(group_sizes)
  _check_shapes(lhs, rhs, group_sizes)
  out_dtype = jnp.dtype(preferred_element_type or jnp.result_type(lhs.dtype, rhs.dtype))
  spec = _Spec(config_from_rule(rule), out_dtype.name, lhs.dtype.name, rhs.dtype.name,
               _tile_rows(lhs.shape[0], tile_rows), _strategy(strategy), _kernel(backend), tiles or tiles_lib.Tiles())
  if lhs.shape[0] == 0 or rhs.shape[0] == 0:  # no rows or no groups: nothing to multiply
    return jnp.zeros((lhs.shape[0], rhs.shape[2]), out_dtype)
  return compat.disable_interceptions(_gmm_jit)(lhs, rhs, _fit_rows(group_sizes, lhs.shape[0]), spec)


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


def _kernel(backend) -> str:
  if backend not in gmm_backends.KERNELS:
    raise errors.QuantError(f"grouped matmul kernel {backend!r} is invalid; accepted: "
                            f"{', '.join(gmm_backends.KERNELS)} (resolve 'auto' with gmm_backends.resolve)")
  return backend


def _fit_rows(group_sizes, m: int):
  """int32 group sizes cut so that they sum to at most m (rows past m do not exist)."""
  ends = jnp.clip(jnp.cumsum(group_sizes.astype(jnp.int32)), 0, m)
  return jnp.diff(ends, prepend=0).astype(jnp.int32)


def _rows_in_groups(group_sizes, m: int):
  return (jnp.arange(m) < jnp.sum(group_sizes))[:, None]


# ---------------------------------------------------------------------------------------------------------------
# Custom VJP.


def _quantize(x, qtype, axis: int, calibration: str, channelwise: bool):
  return fp8.quantize(x, qtype, [axis] if channelwise else [], calibration, scale_dtype=jnp.float32)


def _matmul(spec: _Spec, lhs, rhs, group_sizes, *, tiling, transpose_rhs=False, row_scale=None, col_scale=None,
            out_dtype=jnp.float32):
  return gmm_backends.matmul(spec.backend, lhs, rhs, group_sizes, tile_rows=spec.tile_rows, strategy=spec.strategy,
                             tiling=tiling, transpose_rhs=transpose_rhs, row_scale=row_scale, col_scale=col_scale,
                             out_dtype=out_dtype)


def _masked(spec: _Spec, out, group_sizes):
  """`out` with zeros in the rows past the groups (already there from a kernel of `gmm_backends.ZERO_TAIL`)."""
  if spec.backend in gmm_backends.ZERO_TAIL:
    return out
  return jnp.where(_rows_in_groups(group_sizes, out.shape[0]), out, jnp.zeros((), out.dtype))


def _fwd(lhs, rhs, group_sizes, spec: _Spec):
  cfg, rhs_scale = spec.config, None
  if cfg is not None and cfg.weight_qtype is not None:
    rhs, rhs_scale = _quantize(rhs, cfg.weight_qtype, 2, cfg.weight_calibration, cfg.channelwise)  # [1, 1, N|1]
  out, lhs, lhs_scale = _fwd_with_rhs(lhs, rhs, rhs_scale, group_sizes, spec)
  return out, (lhs, lhs_scale, rhs, rhs_scale, group_sizes)


def _fwd_with_rhs(lhs, rhs, rhs_scale, group_sizes, spec: _Spec):
  """Forward on rhs (fp8 with its float32 scale [1, 1, N|1], or float with None): (output, lhs used, its scale)."""
  cfg, lhs_scale = spec.config, None
  if cfg is not None and cfg.act_qtype is not None and cfg.act_tile:  # DeepSeek's 1 x tile activations, dequantized
    lhs = act_tiles.fake_quantize(lhs, (1,), cfg.act_tile, cfg.act_qtype)
  elif cfg is not None and cfg.act_qtype is not None:
    lhs, lhs_scale = _quantize(lhs, cfg.act_qtype, 0, cfg.act_calibration, cfg.channelwise)  # scale [M|1, 1]
  # The scales multiply the float32 products (row scale, then column scale) before the one rounding to the output
  # dtype: inside the Pallas kernel (no float32 [M, N] in memory), after the other kernels.
  out = _matmul(spec, lhs, rhs, group_sizes, tiling=spec.tiles.fwd, row_scale=lhs_scale, col_scale=rhs_scale,
                out_dtype=spec.out_dtype)
  return _masked(spec, out, group_sizes), lhs, lhs_scale


def _bwd(spec: _Spec, residuals, grad):
  lhs, lhs_scale, rhs, rhs_scale, group_sizes = residuals
  cfg = spec.config
  bwd_qtype = None if cfg is None else cfg.bwd_qtype
  in_groups = _rows_in_groups(group_sizes, grad.shape[0])
  grad = jnp.where(in_groups, grad, jnp.zeros_like(grad))  # outputs past the groups are constant zeros

  # dlhs = (g * rhs_scale) @ rhs^T: the weight scale moves onto the gradient so the fp8 rhs is reused.
  dlhs_dout = grad if rhs_scale is None else grad * rhs_scale.astype(grad.dtype).reshape(1, -1)
  dlhs_scale = None
  if bwd_qtype is not None:
    dlhs_dout, dlhs_scale = _quantize(dlhs_dout, bwd_qtype, 0, cfg.bwd_calibration, cfg.channelwise)
  dlhs = _matmul(spec, dlhs_dout, rhs, group_sizes, tiling=spec.tiles.dlhs, transpose_rhs=True, row_scale=dlhs_scale,
                 out_dtype=spec.lhs_dtype)
  dlhs = _masked(spec, dlhs, group_sizes)

  # drhs[g] = lhs[rows of g]^T @ (g * lhs_scale), the gradient quantized per output column.
  drhs_dout = grad if lhs_scale is None else jnp.where(in_groups, grad * lhs_scale.astype(grad.dtype), 0)
  drhs_scale = None
  if bwd_qtype is not None:
    drhs_dout, drhs_scale = _quantize(drhs_dout, bwd_qtype, 1, cfg.bwd_calibration, cfg.channelwise)
  drhs = gmm_backends.outer(spec.backend, lhs, drhs_dout, group_sizes, tile_rows=spec.tile_rows,
                            strategy=spec.strategy, tiling=spec.tiles.drhs, col_scale=drhs_scale,
                            out_dtype=spec.rhs_dtype)
  return dlhs.astype(spec.lhs_dtype), drhs.astype(spec.rhs_dtype), None


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _gmm_vjp(lhs, rhs, group_sizes, spec):
  return _fwd(lhs, rhs, group_sizes, spec)[0]


_gmm_vjp.defvjp(compat.disable_interceptions(_fwd), compat.disable_interceptions(_bwd))
_gmm_jit = jax.jit(_gmm_vjp, static_argnums=(3,))  # one compilation per shape and spec when called eagerly


def prequantized_gmm(lhs, rhs_qvalue, rhs_scale, group_sizes, rule, preferred_element_type=None, *, tile_rows=None,
                     strategy=None, backend="reference", tiles: tiles_lib.Tiles | None = None):
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
    tile_rows, strategy, backend, tiles: as for `quantized_gmm`.
  """
  lhs, rhs_qvalue, group_sizes = jnp.asarray(lhs), jnp.asarray(rhs_qvalue), jnp.asarray(group_sizes)
  _check_shapes(lhs, rhs_qvalue, group_sizes)
  cfg = config_from_rule(rule)
  if cfg is None or cfg.weight_qtype is None:
    raise errors.QuantError("a pre-quantized grouped-matmul weight needs a rule that quantizes weights; "
                            "accepted: a qwix.QtRule with weight_qtype set")
  scale = jnp.asarray(rhs_scale, jnp.float32)
  if scale.size not in (1, rhs_qvalue.shape[2]):
    raise errors.QuantError(f"grouped matmul weight scale of shape {scale.shape} does not fit a weight of shape "
                            f"{rhs_qvalue.shape}; accepted: [1, 1, N] or one scale")
  out_dtype = jnp.dtype(preferred_element_type or lhs.dtype)
  spec = _Spec(cfg, out_dtype.name, lhs.dtype.name, rhs_qvalue.dtype.name, _tile_rows(lhs.shape[0], tile_rows),
               _strategy(strategy), _kernel(backend), tiles or tiles_lib.Tiles())
  if lhs.shape[0] == 0 or rhs_qvalue.shape[0] == 0:
    return jnp.zeros((lhs.shape[0], rhs_qvalue.shape[2]), out_dtype)
  return compat.disable_interceptions(_prequantized_jit)(lhs, rhs_qvalue, scale.reshape(1, 1, -1),
                                                         _fit_rows(group_sizes, lhs.shape[0]), spec)


@functools.partial(jax.jit, static_argnums=(4,))
def _prequantized_jit(lhs, rhs_qvalue, rhs_scale, group_sizes, spec):
  return _fwd_with_rhs(lhs, rhs_qvalue, rhs_scale, group_sizes, spec)[0]
