"""MaxText's fp8_full rule on one product, against numpy's FP8 arithmetic on the same inputs (made on the device):
Qwix's QT dot_general and our grouped matmul. Shared by tests/test_tpu_chip.py and scripts/tpu_numerics.py."""

from __future__ import annotations

import dataclasses

from flax import nnx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import qwix

from quant.gmm import backends as gmm_backends
from quant.gmm import fp8 as gmm_fp8

E4M3 = jnp.float8_e4m3fn


def rel(x, y) -> float:
  x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
  return float(np.linalg.norm(x - y) / np.linalg.norm(y))


def e4m3(x, axes):
  """numpy: x rounded to e4m3 with an absmax scale per index of the axes not in `axes` (those reduced)."""
  amax = np.max(np.abs(x), axis=axes, keepdims=True)
  scale = amax / float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)
  return (x / scale).astype(ml_dtypes.float8_e4m3fn).astype(np.float64) * scale


@dataclasses.dataclass(frozen=True)
class Products:
  """Relative errors of each product against numpy's FP8 arithmetic and against the unquantized product."""

  dense_vs_fp8: float
  dense_vs_plain: float
  gmm_vs_fp8: float
  gmm_vs_plain: float
  backend: str


def measure(backend: str = "auto") -> Products:
  k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(k1, (256, 512), jnp.float32)
  w = jax.random.normal(k2, (512, 384), jnp.float32) * 512**-0.5

  class Layer(nnx.Module):
    """The smallest module Qwix intercepts: one dot_general of an activation with a weight Param."""

    def __init__(self):
      self.kernel = nnx.Param(w)

    def __call__(self, inputs):
      return jax.lax.dot_general(inputs, self.kernel[...], (((1,), (0,)), ((), ())),
                                 precision=jax.lax.Precision.HIGHEST)

  rule = qwix.QtRule(module_path=".*", weight_qtype=E4M3, act_qtype=E4M3, bwd_qtype=jnp.float8_e5m2)
  dense = jax.jit(lambda m, a: m(a))(qwix.quantize_model(Layer(), qwix.QtProvider([rule]), x), x)
  x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
  rhs = jax.random.normal(k3, (3, 512, 384), jnp.float32) * 512**-0.5
  kernel = gmm_backends.resolve(backend)
  out = gmm_fp8.quantized_gmm(x, rhs, jnp.asarray([100, 0, 156], jnp.int32), rule, jnp.float32, backend=kernel)
  r64 = np.asarray(rhs, np.float64)
  xq, rq = e4m3(x64, (1,)), e4m3(r64, (0, 1))
  return Products(dense_vs_fp8=rel(dense, e4m3(x64, (1,)) @ e4m3(w64, (0,))), dense_vs_plain=rel(dense, x64 @ w64),
                  gmm_vs_fp8=rel(out, np.concatenate([xq[:100] @ rq[0], xq[100:] @ rq[2]])),
                  gmm_vs_plain=rel(out, np.concatenate([x64[:100] @ r64[0], x64[100:] @ r64[2]])), backend=kernel)
