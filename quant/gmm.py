"""The grouped matmul of routed experts: rows sorted by expert, rows of group g use `rhs[g]`.

`gmm` is the op the MoE block calls for each expert matmul (wi_0, wi_1, wo). Like MaxText's Megablox
`gmm`, it asks Qwix for the rule of the calling module (`get_current_rule("gmm")`, which Qwix answers only
while it intercepts a model call and never logs) and then either runs a plain grouped matmul or hands the
work to the FP8 grouped matmul (`quant.gmm_fp8.quantized_gmm`).

The plain path never shows up as an op of its own under Qwix: it is traced with Qwix's interception
switched off, and it is built from `dot_general` primitives (never `lax.ragged_dot`, whose CPU lowering
re-traces a Python `dot_general` that Qwix would see when the model runs eagerly).
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp


def current_rule():
  """Qwix's rule for a "gmm" op of the calling module, or None outside a Qwix-intercepted call."""
  if "qwix" not in sys.modules:  # Qwix not loaded: nothing can be intercepting.
    return None
  from qwix._src import qconfig  # pylint: disable=import-outside-toplevel

  return qconfig.get_current_rule("gmm")


def _without_interception(fn):
  """`fn` run with every Qwix interceptor of this thread disabled (a no-op when Qwix is not loaded)."""
  if "qwix" not in sys.modules:
    return fn
  from qwix._src import interception  # pylint: disable=import-outside-toplevel

  return interception.disable_interceptions(fn)


def group_ids(group_sizes: jax.Array, num_rows: int) -> jax.Array:
  """The group of each row (rows past `sum(group_sizes)` get `len(group_sizes)`, i.e. no group)."""
  ends = jnp.cumsum(group_sizes.astype(jnp.int32))
  rows = jnp.arange(num_rows, dtype=jnp.int32)
  return jnp.searchsorted(ends, rows, side="right").astype(jnp.int32)


def _plain_gmm(lhs, rhs, group_sizes, preferred_element_type):
  """Grouped matmul: `out[r] = lhs[r] @ rhs[group(r)]`, rows outside every group are zero.

  One masked dense matmul per group, accumulated in float32 (the work of XLA's own CPU `ragged_dot`).
  """
  out_dtype = preferred_element_type or jnp.result_type(lhs.dtype, rhs.dtype)
  gid = group_ids(group_sizes, lhs.shape[0])

  def one_group(acc, g_and_w):
    g, w = g_and_w
    y = jax.lax.dot_general(lhs, w, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    return jnp.where((gid == g)[:, None], y, acc), None

  init = jnp.zeros((lhs.shape[0], rhs.shape[2]), jnp.float32)
  groups = jnp.arange(rhs.shape[0], dtype=jnp.int32)
  out, _ = jax.lax.scan(one_group, init, (groups, rhs))
  return out.astype(out_dtype)


def gmm(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *, preferred_element_type=None,
        rule=None) -> jax.Array:
  """Grouped matmul of row-sorted tokens `lhs` [M, K] with expert weights `rhs` [G, K, N] → [M, N].

  Args:
    lhs: rows sorted by group; the first `group_sizes[0]` rows belong to group 0, and so on.
    rhs: one [K, N] matrix per group.
    group_sizes: [G] integer row counts.
    preferred_element_type: output dtype (default: the promoted input dtype).
    rule: a Qwix rule to use instead of asking Qwix for the calling module's "gmm" rule.

  Returns:
    [M, N]; with a rule that quantizes weights, the FP8 grouped matmul's result.
  """
  if lhs.ndim != 2 or rhs.ndim != 3 or lhs.shape[1] != rhs.shape[1] or group_sizes.shape != rhs.shape[:1]:
    raise ValueError(f"gmm expects lhs [M, K], rhs [G, K, N], group_sizes [G]; got {lhs.shape}, {rhs.shape}, "
                     f"{group_sizes.shape}")
  if rule is None:
    rule = current_rule()  # outside any custom_vjp, as MaxText does
  if rule is not None and getattr(rule, "weight_qtype", None) is not None:
    return _quantized_gmm(lhs, rhs, group_sizes, rule, preferred_element_type)
  return _without_interception(_plain_gmm)(lhs, rhs, group_sizes, preferred_element_type)


def _quantized_gmm(lhs, rhs, group_sizes, rule, preferred_element_type):
  try:
    from quant import gmm_fp8  # pylint: disable=import-outside-toplevel
  except ModuleNotFoundError as e:
    if e.name != "quant.gmm_fp8":
      raise
    raise NotImplementedError("a quantizing gmm rule needs quant.gmm_fp8, which is not available") from None
  return gmm_fp8.quantized_gmm(lhs, rhs, group_sizes, rule, preferred_element_type)
