"""The Qwix provider of each `quantization` mode, MaxText's NVIDIA and NANOO FP8 providers included.

MaxText runs `fp8_gpu` and `fp8_nanoo` through providers of its own (`NvidaFp8Provider`, `NANOOFp8Provider`
in its `layers/quantizations.py`): a `dot_general` (and, for NVIDIA, an `einsum`) whose rule is not None runs
Flax's delayed-scaling FP8 op instead of Qwix's quantized op:

* fp8_gpu (NVIDIA): `Fp8DirectDotGeneralOp` / `Fp8Einsum`: both operands cast to float8_e4m3fn with one
  per-tensor scale each, the matmul on the fp8 values, the gradient in float8_e5m2.
* fp8_nanoo (AMD): `NANOOFp8DotGeneralOp`: both operands quantized and dequantized through float8_e4m3fnuz,
  the output gradient through float8_e5m2fnuz; einsums stay unquantized.

Delayed scaling takes each scale from an amax history that training updates; a fresh model starts with
scale 1 and an empty history, and that is what one forward (or gradient) pass here uses: the Flax ops run on
that initial state, so the operands are cast to fp8 with saturation (±448 e4m3fn, ±240 e4m3fnuz), unscaled.
Neither provider handles `gmm` or `ragged_dot`: their rules name only dot_general, so the routed experts run
unquantized (bf16) under both, as in MaxText. Every other mode uses `qwix.QtProvider`.
"""

from __future__ import annotations

import functools

from flax.linen import fp8_ops
import jax
import jax.numpy as jnp
import qwix

from quant import compat
from quant import rounding
from quant import rules as rules_lib

AMAX_HISTORY_LENGTH = 1024  # Flax's default, as MaxText uses it


def _fresh_state():
  """Scales and amax histories of a fresh delayed-scaling op (Flax's initial values)."""
  scale, history = jnp.ones((1,), jnp.float32), jnp.zeros((AMAX_HISTORY_LENGTH,), jnp.float32)
  return {"lhs_scale": scale, "rhs_scale": scale, "grad_scale": scale, "lhs_amax_history": history,
          "rhs_amax_history": history, "grad_amax_history": history}


def _fp8_ops():
  return fp8_ops


def nvidia_dot_general(lhs, rhs, dimension_numbers):
  """Flax's `Fp8DirectDotGeneralOp` on its initial state: e4m3fn operands, e5m2 gradient, rhs's dtype out."""
  lhs = jnp.asarray(lhs, rhs.dtype)
  return _fp8_ops().fp8_scaled_dot_general(lhs, rhs, dimension_numbers, preferred_element_type=lhs.dtype,
                                           quantize_compute_type=rhs.dtype, **_fresh_state())


def nvidia_einsum(equation, lhs, rhs, preferred_element_type=None):
  """Flax's `Fp8Einsum` on its initial state."""
  lhs = jnp.asarray(lhs, rhs.dtype)
  dot = functools.partial(_fp8_ops().fp8_scaled_dot_general, quantize_compute_type=rhs.dtype, **_fresh_state())
  return jnp.einsum(equation, lhs, rhs, preferred_element_type=preferred_element_type, _dot_general=dot)


def nanoo_dot_general(lhs, rhs, dimension_numbers):
  """Flax's `NANOOFp8DotGeneralOp` on its initial state: e4m3fnuz operands (fake-quantized), e5m2fnuz gradient."""
  ops, state = _fp8_ops(), _fresh_state()
  lhs = jnp.asarray(lhs, rhs.dtype)
  lhs_qdq = ops.in_qdq(rhs.dtype, jnp.float8_e4m3fnuz, lhs, state["lhs_scale"], state["lhs_amax_history"])
  rhs_qdq = ops.in_qdq(rhs.dtype, jnp.float8_e4m3fnuz, rhs, state["rhs_scale"], state["rhs_amax_history"])
  out = ops.dot_general_with_precision(lhs_qdq, rhs_qdq, dimension_numbers)
  return ops.out_qdq(rhs.dtype, jnp.float8_e5m2fnuz, out, state["grad_scale"], state["grad_amax_history"])


class _VendorFp8Provider(qwix.QtProvider):
  """MaxText's vendor providers: a dot_general with a rule runs `fp8_dot_general`, one without runs plain."""

  fp8_dot_general = staticmethod(nvidia_dot_general)

  def dot_general(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, **kwargs):
    if compat.provider_rule(self, "dot_general") is None:
      return jax.lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                                 preferred_element_type=preferred_element_type, **kwargs)
    return self.fp8_dot_general(lhs, rhs, dimension_numbers)


class NvidiaFp8Provider(_VendorFp8Provider):
  """MaxText's fp8_gpu provider: dot_general and einsum with a rule run Flax's FP8 ops."""

  def einsum(self, equation, *operands, precision=None, preferred_element_type=None, **kwargs):
    if compat.provider_rule(self, "einsum") is None or len(operands) != 2:
      return jnp.einsum(equation, *operands, precision=precision, preferred_element_type=preferred_element_type,
                        **kwargs)
    return nvidia_einsum(equation, *operands, preferred_element_type=preferred_element_type)


class NanooFp8Provider(_VendorFp8Provider):
  """MaxText's fp8_nanoo provider: dot_general with a rule runs Flax's NANOO FP8 op."""

  fp8_dot_general = staticmethod(nanoo_dot_general)


PROVIDER_CLASSES = {"qt": qwix.QtProvider, "nvidia_fp8": NvidiaFp8Provider, "nanoo_fp8": NanooFp8Provider}


def provider(quantization: str, rules):
  """The Qwix provider MaxText uses for `quantization` (see `quant.rules.PROVIDERS`), over `rules`; Qwix's on-the-fly
  quantization divides as a CPU does on every backend (`compat.exact_qwix_quantization`)."""
  compat.exact_qwix_quantization(rounding.quotient, rounding.by_constant)
  return PROVIDER_CLASSES[rules_lib.provider_name(quantization) or "qt"](list(rules))
