"""The grouped matmul of routed experts: rows sorted by expert, rows of group g use `rhs[g]`.

`gmm` is the op the MoE block calls for each expert matmul (wi_0, wi_1, wo). Like MaxText's Megablox
`gmm`, it asks Qwix for the rule of the calling module (`qwix.pallas.get_current_rule("gmm")`, which Qwix
answers only while it intercepts a model call and never logs) and hands the work to the grouped matmul of
`quant.gmm.fp8`: FP8 for what the rule quantizes (weights, activations, gradients: each on its own, as in
Megablox), plain without a rule. `backend` picks the kernel (`quant.gmm.backends`: "auto" is our Pallas kernel
on TPU, ragged_dot on GPU, the tiled reference on CPU), `tiles` its tilings (MaxText's tile keys).

The weight may also come quantized ahead of time (an FP8 export loaded under Qwix PTQ): a `QArray`, or a PTQ
`WithAux` of one, holding fp8 `qvalue` [G, K, N] and a per-column `scale`. With a quantizing rule the FP8 grouped
matmul then uses the stored values (`quant.gmm.fp8.prequantized_gmm`); without one the weight is dequantized.

Neither path shows up as an op of its own under Qwix: `quant.gmm.fp8` runs with Qwix's interception switched
off, so no kernel's inner ops (e.g. the `dot_general` that XLA's CPU ragged_dot re-traces) are seen.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import qwix.pallas

from quant import compat
from quant.gmm import backends as gmm_backends
from quant.gmm import fp8 as gmm_fp8
from quant.gmm import tiles as gmm_tiles


def current_rule(op_name: str = "gmm"):
  """Qwix's rule for an `op_name` op of the calling module, or None outside a Qwix-intercepted call."""
  if "qwix" not in sys.modules:  # Qwix not loaded: nothing can be intercepting.
    return None

  return qwix.pallas.get_current_rule(op_name)


def gmm(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *, preferred_element_type=None,
        rule=None, backend: str = "auto", tiles: gmm_tiles.Tiles | None = None) -> jax.Array:
  """Grouped matmul of row-sorted tokens `lhs` [M, K] with expert weights `rhs` [G, K, N] → [M, N].

  Args:
    lhs: rows sorted by group; the first `group_sizes[0]` rows belong to group 0, and so on.
    rhs: one [K, N] matrix per group, float or quantized ahead of time (see `prequantized`).
    group_sizes: [G] integer row counts.
    preferred_element_type: output dtype (default: the promoted input dtype).
    rule: a Qwix rule to use instead of asking Qwix for the calling module's "gmm" rule.
    backend: a `quant.gmm.backends.BACKENDS` name; "auto" by JAX's default backend.
    tiles: the Pallas kernels' tilings (forward, dlhs, drhs); default `quant.gmm.tiles.Tiles()`.

  Returns:
    [M, N]; with a rule that quantizes anything, the FP8 grouped matmul's result.

  Raises:
    quant.errors.QuantError: an unknown or unavailable backend.
  """
  if lhs.ndim != 2 or rhs.ndim != 3 or lhs.shape[1] != rhs.shape[1] or group_sizes.shape != rhs.shape[:1]:
    raise ValueError(f"gmm expects lhs [M, K], rhs [G, K, N], group_sizes [G]; got {lhs.shape}, {rhs.shape}, "
                     f"{group_sizes.shape}")
  kernel = gmm_backends.resolve(backend)
  if rule is None:
    rule = current_rule()  # outside any custom_vjp, as MaxText does
  stored = prequantized(rhs)
  if stored is not None:
    qvalue, scale = stored
    if getattr(rule, "weight_qtype", None) is not None:
      return gmm_fp8.prequantized_gmm(lhs, qvalue, scale, group_sizes, rule, preferred_element_type, backend=kernel,
                                      tiles=tiles)
    rhs = (qvalue.astype(jnp.float32) * scale.astype(jnp.float32)).astype(lhs.dtype)
  # Every path runs in `gmm_fp8` with Qwix interception off; a rule that quantizes nothing is the plain one.
  return gmm_fp8.quantized_gmm(lhs, rhs, group_sizes, rule, preferred_element_type, backend=kernel, tiles=tiles)


def prequantized(rhs):
  """(qvalue, scale) of a weight quantized ahead of time (a `QArray` or a Qwix PTQ `WithAux` of one), else None."""
  array = getattr(rhs, "array", rhs)
  qvalue, scale = getattr(array, "qvalue", None), getattr(array, "scale", None)
  if qvalue is None or scale is None:
    return None
  if getattr(array, "zero_point", None) is not None:
    raise ValueError("gmm supports symmetric pre-quantized weights only (zero_point None)")
  return qvalue, scale


def prequantized_ragged_dot(lhs, rhs, group_sizes, *, preferred_element_type=None, rule=None):
  """`jax.lax.ragged_dot` with a weight quantized ahead of time, as Qwix QT's quantized ragged_dot runs it.

  For `megablox=false` models: the forward of Qwix's `ragged_dot_qt` (activations per row with the rule's
  act_qtype, the stored fp8 weight with its per-column scale, Qwix's quantized ragged_dot), so an FP8 export
  reproduces that path exactly. Without a quantizing rule (asked from Qwix as "ragged_dot") the weight is
  dequantized and a plain ragged_dot runs. Interception is off inside (JAX's CPU ragged_dot issues dot_generals).
  """
  stored = prequantized(rhs)
  if stored is None:
    raise ValueError("prequantized_ragged_dot needs a QArray weight (or a Qwix PTQ WithAux of one)")
  qvalue, scale = stored
  if rule is None:
    rule = current_rule("ragged_dot")
  if rule is None or getattr(rule, "weight_qtype", None) is None:
    weight = (qvalue.astype(jnp.float32) * scale.astype(jnp.float32)).astype(lhs.dtype)
    return compat.disable_interceptions(jax.lax.ragged_dot)(
        lhs, weight, group_sizes, preferred_element_type=preferred_element_type)

  def run(lhs, qvalue, scale, group_sizes):
    if rule.act_qtype is not None:
      lhs = qwix.quantize(lhs, rule.act_qtype, channelwise_axes=[0])
    weight = qwix.QArray(qvalue, scale, None, qvalue.dtype)
    return qwix.ragged_dot(lhs, weight, group_sizes, None, preferred_element_type)

  return compat.disable_interceptions(run)(lhs, qvalue, scale, group_sizes)
