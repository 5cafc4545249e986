"""DeepSeek-V3.2's lightning indexer: which keys each query may attend to (DeepSeek Sparse Attention).

MaxText 0.2.5's `self_attention/indexer` of an MLA layer (`use_indexer=true`): parameters `wq_b`
(q_lora_rank, H, D), `wk` (E, D), `k_norm` (a LayerNorm with `scale` and `bias`, float32) and
`weights_proj` (E, H, float32 whatever `weight_dtype` is). Letters: b batch, t query position, s key
position, h indexer head (`indexer_n_heads`), d indexer head dim (`indexer_head_dim`), k `indexer_topk`.

  q = rope(wq_b(q_latent))            [b, t, h, d]   rope on the first `qk_rope_head_dim` dims, halves layout
  k = rope(k_norm(wk(x)))             [b, s, d]      one key shared by all heads
  w = weights_proj(x) · h^-½ · d^-½   [b, t, h]      float32
  score = Σ_h w · relu(q·k)           [b, t, s]      plus the causal/segment mask (0 or a large negative)
  keep = the k best scores per query (ties: earlier positions first) among the allowed keys

With as many keys as `indexer_topk` or fewer MaxText skips the selection after the key projection (every
allowed key is kept), so `weights_proj` and the two score einsums then run on no op at all. The indexer's
inputs are `stop_gradient`ed, as in MaxText. Op structure for Qwix: `wq_b`, `wk`, `weights_proj` are
`dot_general`s of their own modules; the two score contractions are `jnp.einsum`s of `indexer`.
"""

from __future__ import annotations

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

from inspect_tool.model import initializers as inits
from inspect_tool.model import layers

DEFAULT_MASK_VALUE = -0.7 * float(np.finfo(np.dtype("float32")).max)
LAYER_NORM_EPSILON = 1e-6  # nnx.LayerNorm's default, which MaxText's indexer keeps


class LayerNorm(nnx.Module):
  """`nnx.LayerNorm` numerics (float32 statistics, fast variance) with float32 `scale` and `bias` Params."""

  def __init__(self, num_features: int, make: inits.VariableFactory):
    self.scale = make.make((num_features,), inits.ones, dtype=jnp.float32)
    self.bias = make.make((num_features,), inits.zeros, dtype=jnp.float32)

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = jnp.asarray(x, jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    mean_sq = jnp.mean(jax.lax.square(x32), axis=-1, keepdims=True)
    var = jnp.maximum(0.0, mean_sq - jax.lax.square(mean))
    mul = jax.lax.rsqrt(var + LAYER_NORM_EPSILON) * jnp.asarray(self.scale[...], jnp.float32)
    return (x - mean) * mul + jnp.asarray(self.bias[...], jnp.float32)


def additive_mask(allowed: jax.Array) -> jax.Array:
  """Boolean [b, t, s] → MaxText's additive float32 mask (0 where allowed, a large negative elsewhere)."""
  return jnp.where(allowed, 0.0, DEFAULT_MASK_VALUE).astype(jnp.float32)


def keep_top_k(score: jax.Array, cutoff: jax.Array, top_k: int, exact: bool) -> jax.Array:
  """Boolean [b, t, s]: the keys of each row that the top-k selection keeps, given the k-th best `cutoff`.

  `exact` (MaxText's `indexer_mask_exact_topk`, default true): exactly `top_k` keys; among keys tied at
  the cut-off value the earliest positions win. Otherwise every key scoring at least the cut-off.
  """
  if not exact:
    return score >= cutoff
  above = score > cutoff
  tied = score == cutoff
  above_rank = jnp.cumsum(above.astype(jnp.int32), axis=-1)
  tied_rank = jnp.cumsum(tied.astype(jnp.int32), axis=-1)
  kept_above = jnp.minimum(above_rank[..., -1:], top_k)
  return (above & (above_rank <= top_k)) | (tied & (tied_rank <= top_k - kept_above))


class Indexer(nnx.Module):
  """MaxText's `Indexer`; `__call__` returns the boolean keep mask [b, t, s], or None when it keeps all."""

  def __init__(self, cfg, rotary_embedding: nnx.Module, make: inits.VariableFactory):
    e, h, d = cfg.emb_dim, cfg.indexer_n_heads, cfg.indexer_head_dim
    self.n_heads, self.head_dim = h, d
    self.top_k = int(cfg.indexer_topk)
    self.exact_top_k = bool(cfg.indexer_mask_exact_topk)
    self.approx_top_k = bool(cfg.indexer_use_approx_top_k)
    self.approx_recall = float(cfg.indexer_approx_top_k_recall)
    self.rope_dim = cfg.qk_rope_head_dim
    self.precision = layers.precision(cfg)
    self.rotary_embedding = rotary_embedding
    normal = dict(distribution="normal")
    self.wq_b = layers.DenseGeneral(cfg, cfg.q_lora_rank, (h, d), make, **normal)
    self.wk = layers.DenseGeneral(cfg, e, d, make, **normal)
    self.k_norm = LayerNorm(d, make)
    self.weights_proj = layers.DenseGeneral(cfg, e, h, make, dtype=jnp.float32, weight_dtype=jnp.float32,
                                            **normal)

  def _partial_rope(self, x: jax.Array, positions: jax.Array) -> jax.Array:
    """RoPE on the leading `qk_rope_head_dim` dims of [b, s, n, d] (MLA puts them last instead)."""
    x_pe, x_nope = jnp.split(x, [self.rope_dim], axis=-1)
    return jnp.concatenate([self.rotary_embedding(x_pe, positions), x_nope], axis=-1)

  def _top_k_values(self, score: jax.Array) -> jax.Array:
    if self.approx_top_k:
      return jax.lax.approx_max_k(score, self.top_k, recall_target=self.approx_recall)[0]
    return jax.lax.top_k(score, self.top_k)[0]

  def __call__(self, x: jax.Array, q_latent: jax.Array, positions: jax.Array, allowed: jax.Array):
    """x [b, s, E], q_latent [b, t, q_lora_rank] (after `q_norm`), allowed [b or 1, t, s] boolean."""
    x, q_latent = jax.lax.stop_gradient(x), jax.lax.stop_gradient(q_latent)
    q = self._partial_rope(self.wq_b(q_latent), positions)                                  # [b, t, h, d]
    k = self._partial_rope(self.k_norm(self.wk(x))[:, :, None, :], positions)[:, :, 0, :]  # [b, s, d]
    if k.shape[1] <= self.top_k:
      return None
    weights = self.weights_proj(x) * (self.n_heads ** -0.5) * (self.head_dim ** -0.5)      # [b, t, h]
    logits = jax.nn.relu(jnp.einsum("bthd, bsd -> btsh", q, k, precision=self.precision))
    score = jnp.einsum("btsh, bth -> bts", logits, weights, precision=self.precision)
    score = score + additive_mask(allowed)
    cutoff = self._top_k_values(score)[..., -1:]
    keep = keep_top_k(score, cutoff, self.top_k, self.exact_top_k)
    return keep & allowed

