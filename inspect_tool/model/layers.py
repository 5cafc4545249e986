"""Basic layers with MaxText's names, parameter shapes, dtypes and op structure.

Op structure matters for Qwix, which intercepts `jax.lax.dot_general` and `jnp.einsum` and attributes
each call to the nearest `nnx.Module` on the Python stack: every `DenseGeneral` calls `lax.dot_general`
inside its own `__call__`, every `RMSNorm` multiplies its scale with one `jnp.einsum`, and the embedding
lookup is a gather (no op Qwix sees).
"""

from __future__ import annotations

from typing import Sequence

from flax import nnx
import jax
import jax.numpy as jnp

from inspect_tool.model import initializers as inits
from inspect_tool.model import remat


def compute_dtype(cfg) -> jnp.dtype:
  return jnp.dtype(cfg.dtype)


def precision(cfg) -> jax.lax.Precision:
  return jax.lax.Precision(cfg.matmul_precision)


def kernel_value(kernel, dtype):
  """A kernel cast to `dtype` the way MaxText reads it: `jnp.asarray` of the unboxed value.

  After Qwix PTQ the attribute holds a `WithAux` of a quantized array instead of a Param; it is passed
  to `jnp.asarray` as is, which PTQ intercepts.
  """
  if isinstance(kernel, nnx.Variable):
    kernel = kernel.get_value()
  return jnp.asarray(kernel, dtype)


def activation_operand(x: jax.Array) -> jax.Array:
  """`x` unchanged (x + 0), ending Qwix's search for the weight behind a matmul operand at `x` itself.

  Qwix's QT provider decides which operand is a weight by following unary ops back to the module's Params and,
  failing that, by comparing shapes with the Params, but it compares the last operand it reached, not `x`: an
  activation made by a transposed `einsum` (an RMSNorm's output, e.g. MLA's `kv_norm` before `wkv_b`) is compared
  in its pre-transpose shape, which can equal the kernel's ([B, S, r] → [r, B, S] against wkv_b's [r, H, D] when
  B = H and S = D: deepseek3-tiny at 4 sequences of 256), and Qwix stops ("lhs and rhs cannot be both weights", as
  MaxText's own train_compile does there). The add ends the search at `x`'s own shape.
  """
  return x + jnp.zeros_like(x)


def _tuple(x) -> tuple[int, ...]:
  return tuple(x) if isinstance(x, (tuple, list)) else (int(x),)


class RMSNorm(nnx.Module):
  """RMS normalisation in float32, output in the compute dtype, then `einsum` with the `scale` Param."""

  def __init__(self, cfg, num_features: int, make: inits.VariableFactory):
    self.epsilon = float(cfg.normalization_layer_epsilon)
    self.dtype = compute_dtype(cfg)
    self.precision = precision(cfg)
    self.scale = make.make((num_features,), inits.ones)

  def __call__(self, x: jax.Array) -> jax.Array:
    x = jnp.asarray(x, jnp.float32)
    mean2 = jnp.mean(jax.lax.square(x), axis=-1, keepdims=True)
    y = jnp.asarray(x * jax.lax.rsqrt(mean2 + self.epsilon), self.dtype)
    scale = jnp.asarray(self.scale[...], self.dtype)
    return jnp.einsum("...k,k->...k", y, scale, precision=self.precision)


class DenseGeneral(nnx.Module):
  """`x @ kernel` contracting the last `len(in_features)` axes of x; kernel shape `in_features + out_features`."""

  def __init__(self, cfg, in_features: int | Sequence[int], out_features: int | Sequence[int],
               make: inits.VariableFactory, *, distribution: str = "truncated_normal", dtype=None,
               weight_dtype=None):
    self.in_features = _tuple(in_features)
    self.out_features = _tuple(out_features)
    self.dtype = jnp.dtype(dtype) if dtype is not None else compute_dtype(cfg)
    self.precision = precision(cfg)
    self.kernel = make.make(self.in_features + self.out_features,
                            inits.dense(range(len(self.in_features)), distribution), dtype=weight_dtype)

  def __call__(self, x: jax.Array) -> jax.Array:
    x = activation_operand(jnp.asarray(x, self.dtype))
    kernel = kernel_value(self.kernel, self.dtype)
    n_in = len(self.in_features)
    axes = tuple(range(x.ndim - n_in, x.ndim))
    return jax.lax.dot_general(x, kernel, ((axes, tuple(range(n_in))), ((), ())), precision=self.precision)


class Embed(nnx.Module):
  """Token embedding table `embedding` (V, E); lookup is a gather in the compute dtype."""

  def __init__(self, cfg, make: inits.VariableFactory):
    self.dtype = compute_dtype(cfg)
    self.embedding = make.make((cfg.vocab_size, cfg.emb_dim), inits.normal(1.0))

  def __call__(self, ids: jax.Array) -> jax.Array:
    table = jnp.asarray(self.embedding[...], self.dtype)
    return table.at[ids.astype(jnp.int32)].get()

  def attend(self, y: jax.Array, dtype) -> jax.Array:
    """Logits through the transposed table (MaxText's `logits_via_embedding`)."""
    table = jnp.asarray(self.embedding[...], dtype)
    return jax.lax.dot_general(jnp.asarray(y, dtype), table, (((y.ndim - 1,), (1,)), ((), ())))


class MlpBlock(nnx.Module):
  """Gated MLP `wo(silu(x @ wi_0) * (x @ wi_1))`: the dense-layer MLP and the shared experts."""

  def __init__(self, cfg, in_features: int, intermediate: int, make: inits.VariableFactory):
    self.dtype = compute_dtype(cfg)
    self.wi_0 = DenseGeneral(cfg, in_features, intermediate, make)
    self.wi_1 = DenseGeneral(cfg, in_features, intermediate, make)
    self.wo = DenseGeneral(cfg, intermediate, in_features, make)

  def __call__(self, x: jax.Array) -> jax.Array:
    gate = jax.nn.silu(remat.name(self.wi_0(x), "mlpwi_0"))
    up = remat.name(self.wi_1(x), "mlpwi_1")
    return remat.name(self.wo((gate * up).astype(self.dtype)), "mlpwo")
