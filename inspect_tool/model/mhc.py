"""Manifold-constrained hyper-connections (mHC): MaxText 0.2.5's `mhc_attention` / `mhc_mlp` and V4's `hc_head`.

With `mhc_expansion_rate` k > 1 the residual stream is k copies wide, [b, s, k, E] (the decoder repeats the
embedding k times). Around each branch (attention, MLP) one `ManifoldConstrainedHyperConnections` module
mixes the copies; letters: b batch, s position, k / m stream, d = E.

  h = mhc_norm(x as [b, s, k·E]) @ [pre_alpha | post_alpha | res_alpha]             [b, s, 2k + k²]
  pre  = sigmoid(pre_alpha_scale · h_pre + pre_beta) + 1e-6                        [b, s, k]
  post = 2 · sigmoid(post_alpha_scale · h_post + post_beta)                        [b, s, k]
  res  = sinkhorn(res_alpha_scale · h_res + res_beta)  (doubly stochastic k×k)     [b, s, k, m]
  out[b, s, m] = Σ_k res[k, m] · x[k] + post[m] · branch(norm(Σ_k pre[k] · x[k]))

Parameters (shapes MaxText's): `mhc_norm.scale` (k·E), `{pre,post}_alpha` (k·E, k), `res_alpha` (k·E, k²),
`*_alpha_scale` (1,), `{pre,post}_beta` (k,), `res_beta` (k, k). Ops Qwix sees: `mhc_norm`'s einsum, then
three einsums of the module (the fused projection, the pre mix, the residual mix), all outside its
`dot_general` rules. `HyperHead` (`decoder/hc_head`) collapses the streams at the end of a DeepSeek-V4 decoder.
"""

from __future__ import annotations

from typing import Callable

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

from inspect_tool import errors
from inspect_tool.model import initializers as inits
from inspect_tool.model import layers

SINKHORN_EPS = 1e-6
PRE_EPS = 1e-6


def constant(value: float) -> inits.Init:
  def init(rng, shape):
    del rng
    return np.full(shape, value, np.float32)
  return init


SCALAR_INIT = constant(0.01)  # MaxText's default_scalar_init


def expand(x: jax.Array, k: int) -> jax.Array:
  """[b, s, E] → [b, s, k, E]: k copies of the stream."""
  return jnp.repeat(jnp.expand_dims(x, axis=2), k, axis=2).astype(x.dtype)


def reduce(x: jax.Array) -> jax.Array:
  """[b, s, k, E] → [b, s, E]: the sum of the copies."""
  return jnp.sum(x, axis=2, dtype=x.dtype)


def sinkhorn(t: jax.Array, iters: int) -> jax.Array:
  """Rows and columns of the last two axes summing to 1 (float32 inside, as MaxText)."""
  dtype = t.dtype
  t = jax.nn.softmax(t.astype(jnp.float32), axis=-1) + SINKHORN_EPS
  t = t / (jnp.sum(t, axis=-2, keepdims=True) + SINKHORN_EPS)
  for _ in range(iters - 1):
    t = t / (jnp.sum(t, axis=-1, keepdims=True) + SINKHORN_EPS)
    t = t / (jnp.sum(t, axis=-2, keepdims=True) + SINKHORN_EPS)
  return t.astype(dtype)


class ManifoldConstrainedHyperConnections(nnx.Module):
  """One mHC wrapper around a branch; `__call__(norm_fn, branch_fn, x)` → [b, s, k, E]."""

  def __init__(self, cfg, make: inits.VariableFactory):
    k, e = cfg.mhc_expansion_rate, cfg.emb_dim
    if cfg.enable_mhc_lite:
      raise errors.ConfigError("enable_mhc_lite=true (permutation-mixture mHC) is not supported; "
                               "accepted: enable_mhc_lite=false")
    self.k = k
    self.dtype = layers.compute_dtype(cfg)
    self.precision = layers.precision(cfg)
    self.iterations = int(cfg.sinkhorn_iterations)
    self.mhc_norm = layers.RMSNorm(cfg, k * e, make)
    self.res_alpha_scale = make.make((1,), SCALAR_INIT)
    self.pre_alpha_scale = make.make((1,), SCALAR_INIT)
    self.post_alpha_scale = make.make((1,), SCALAR_INIT)
    fan_in = inits.dense((0,), "normal")
    self.res_alpha = make.make((k * e, k * k), fan_in)
    self.pre_alpha = make.make((k * e, k), fan_in)
    self.post_alpha = make.make((k * e, k), fan_in)
    self.res_beta = make.make((k, k), inits.zeros)
    self.pre_beta = make.make((k,), inits.zeros)
    self.post_beta = make.make((k,), inits.zeros)

  def _value(self, var) -> jax.Array:
    return jnp.asarray(var[...], self.dtype)

  def _mapping(self, h, alpha_scale, beta, scale: float, eps: float = 0.0):
    return scale * jax.nn.sigmoid(self._value(alpha_scale) * h + self._value(beta)[None, None, :]) + eps

  def __call__(self, norm_fn: Callable, branch_fn: Callable, x: jax.Array, **branch_kwargs) -> jax.Array:
    b, s, k, d = x.shape
    normed = self.mhc_norm(jnp.reshape(x, (b, s, k * d)))
    alphas = jnp.concatenate([self._value(self.pre_alpha), self._value(self.post_alpha),
                              self._value(self.res_alpha)], axis=-1)
    h = jnp.einsum("bsm,mn -> bsn", normed, alphas, precision=self.precision)
    h_pre, h_post, h_res = h[..., :k], h[..., k:2 * k], h[..., 2 * k:]
    pre = self._mapping(h_pre, self.pre_alpha_scale, self.pre_beta, 1.0, eps=PRE_EPS)
    branch_in = jnp.einsum("bsk,bskd->bsd", pre, x, precision=self.precision)
    branch_out = branch_fn(norm_fn(branch_in), **branch_kwargs)
    post = self._mapping(h_post, self.post_alpha_scale, self.post_beta, 2.0)
    post_out = jnp.expand_dims(branch_out, axis=2) * jnp.expand_dims(post, axis=3)
    res_in = self._value(self.res_alpha_scale) * jnp.reshape(h_res, (b, s, k, k)) + self._value(self.res_beta)
    res = sinkhorn(res_in, self.iterations)
    res_out = jnp.einsum("bskm,bskd->bsmd", res, x, precision=self.precision)
    return res_out + post_out


class HyperHead(nnx.Module):
  """DeepSeek-V4's `hc_head`: [b, s, k, E] → [b, s, E], a learned sigmoid-weighted sum of the streams (float32)."""

  def __init__(self, cfg, make: inits.VariableFactory):
    k, e = cfg.mhc_expansion_rate, cfg.emb_dim
    self.dtype = layers.compute_dtype(cfg)
    self.precision = layers.precision(cfg)
    self.hc_fn = make.make((k * e, k), inits.dense((0,), "normal"))
    self.hc_base = make.make((k,), inits.zeros)
    self.hc_scale = make.make((1,), SCALAR_INIT)

  def __call__(self, x: jax.Array) -> jax.Array:
    b, s, k, d = x.shape
    flat = jnp.reshape(x, (b, s, k * d)).astype(jnp.float32)
    flat = flat * jax.lax.rsqrt(jnp.mean(jnp.square(flat), axis=-1, keepdims=True) + PRE_EPS)
    mixes = jnp.einsum("bsm,mk->bsk", flat, jnp.asarray(self.hc_fn[...], jnp.float32), precision=self.precision)
    scale = jnp.asarray(self.hc_scale[...], jnp.float32)[None, None, :]
    pre = jax.nn.sigmoid(mixes * scale + jnp.asarray(self.hc_base[...], jnp.float32)[None, None, :]) + PRE_EPS
    return jnp.sum(pre[:, :, :, None] * x.astype(jnp.float32), axis=2).astype(self.dtype)

