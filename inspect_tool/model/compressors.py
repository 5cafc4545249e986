"""DeepSeek-V4's KV compressors: `hca_compressor` (compress_ratio > 4), `csa_compressor` (4) and its `indexer`.

A compressor turns every `r` consecutive tokens into one extra key/value entry that queries attend to beside
the uncompressed (sliding-window) keys. Letters: b batch, s / t position, n block (s // r), c the r tokens of a
block, d head dim, h indexer head.

  HCA:  kv, gate = kv_proj(x), gate_proj(x)   [b, s, d]
        block[n] = kv_norm(Σ_c softmax_c(gate + position_bias) · kv)            RoPE at the block's first position
  CSA:  kv, gate are 2d wide; block n pools 2r tokens: the first halves (a) of block n-1 and the second halves
        (b) of block n (no previous block: weight 0), same gated sum and norm, RoPE
  V4 indexer: the same CSA pooling of its own (kv_proj, gate_proj, kv_norm, position_bias) gives index keys;
        score[t, n] = Σ_h w[t, h] · relu(q[t, h] · key[n]) · d^-½ with q = RoPE(q_proj(q latent)),
        w = weights_proj(x) · h^-½; each query keeps the `indexer_topk` best blocks that are complete before it.

A block is visible to query t once its last token is at or before t. MaxText 0.2.5's training path (no caches)
is what is modelled.
"""

from __future__ import annotations

from flax import nnx
import jax
import jax.numpy as jnp

from inspect_tool.model import indexer as indexer_lib
from inspect_tool.model import initializers as inits
from inspect_tool.model import layers

DEFAULT_MASK_VALUE = indexer_lib.DEFAULT_MASK_VALUE


def future_blocks(positions: jax.Array, n_blocks: int, ratio: int) -> jax.Array:
  """Boolean [b, t, n]: block n ends after query t (not yet visible)."""
  block_start = positions[:, : n_blocks * ratio: ratio]
  return (block_start[:, None, :] + ratio) > (positions[:, :, None] + 1)


def _windows(x: jax.Array, ratio: int) -> jax.Array:
  b, s = x.shape[:2]
  n = s // ratio
  return jnp.reshape(x[:, : n * ratio], (b, n, ratio, x.shape[-1]))


def overlap_pool(kv, gate, positions, ratio: int, position_bias, norm) -> jax.Array:
  """CSA pooling of [b, s, 2d] projections into [b, n, d] blocks (see the module docstring)."""
  kv_w = _windows(kv, ratio)
  gate_w = _windows(gate, ratio) + jnp.asarray(position_bias[...])
  b = kv_w.shape[0]
  start = positions[:, : kv_w.shape[1] * ratio: ratio]
  previous = jnp.concatenate([start[:, :1] - ratio, start[:, :-1]], axis=1)
  same_doc = (start == previous + ratio)[:, :, None, None]
  a_kv, b_kv = jnp.split(kv_w, 2, axis=-1)
  a_gate, b_gate = jnp.split(gate_w, 2, axis=-1)
  first = (b, 1) + a_kv.shape[2:]
  a_kv = jnp.concatenate([jnp.zeros(first, a_kv.dtype), a_kv[:, :-1]], axis=1)
  a_gate = jnp.concatenate([jnp.full(first, -jnp.inf, a_gate.dtype), a_gate[:, :-1]], axis=1)
  a_kv = jnp.where(same_doc, a_kv, 0.0)
  a_gate = jnp.where(same_doc, a_gate, -jnp.inf)
  pooled_kv = jnp.concatenate([a_kv, b_kv], axis=2)
  weights = jax.nn.softmax(jnp.concatenate([a_gate, b_gate], axis=2), axis=2).astype(pooled_kv.dtype)
  return norm(jnp.sum(pooled_kv * weights, axis=2))


class _Compressor(nnx.Module):
  """Shared parameters: `kv_proj`, `gate_proj` (E → width·d), `position_bias` (r, width·d), `kv_norm` (d)."""

  def __init__(self, cfg, ratio: int, width: int, head_dim: int, make: inits.VariableFactory):
    self.ratio = ratio
    self.head_dim = head_dim
    self.dtype = layers.compute_dtype(cfg)
    normal = dict(distribution="normal")
    self.kv_proj = layers.DenseGeneral(cfg, cfg.emb_dim, width * head_dim, make, **normal)
    self.gate_proj = layers.DenseGeneral(cfg, cfg.emb_dim, width * head_dim, make, **normal)
    self.position_bias = make.make((ratio, width * head_dim), inits.zeros)
    self.kv_norm = layers.RMSNorm(cfg, head_dim, make)

  def _empty(self, x) -> jax.Array:
    return jnp.zeros((x.shape[0], 0, self.head_dim), self.dtype)


class HCACompressor(_Compressor):
  """`hca_compressor`: non-overlapping windows of r tokens; returns ([b, n, 1, d] keys, [b, 1, t, n] mask)."""

  def __init__(self, cfg, ratio: int, make: inits.VariableFactory):
    super().__init__(cfg, ratio, 1, cfg.head_dim, make)

  def __call__(self, x, positions, rope):
    kv, gate = self.kv_proj(x), self.gate_proj(x)
    n = x.shape[1] // self.ratio
    if n > 0:
      weights = jax.nn.softmax(_windows(gate, self.ratio) + jnp.asarray(self.position_bias[...]), axis=2)
      pooled = self.kv_norm(jnp.sum(_windows(kv, self.ratio) * weights.astype(kv.dtype), axis=2))
      pooled = rope(pooled, positions[:, : n * self.ratio: self.ratio], None)
    else:
      pooled = self._empty(x)
    future = future_blocks(positions, n, self.ratio)
    mask = jnp.where(future, DEFAULT_MASK_VALUE, 0.0).astype(self.dtype)[:, None]
    if x.shape[1] == 1:
      mask = jnp.zeros_like(mask)
    return pooled[:, :, None, :], mask


class V4Indexer(_Compressor):
  """`csa_compressor/indexer`: indices [b, t, k] of the blocks each query keeps (-1: none)."""

  def __init__(self, cfg, ratio: int, make: inits.VariableFactory):
    super().__init__(cfg, ratio, 2, cfg.indexer_head_dim, make)
    self.n_heads = cfg.indexer_n_heads
    self.top_k = int(cfg.indexer_topk)
    self.precision = layers.precision(cfg)
    normal = dict(distribution="normal")
    self.q_proj = layers.DenseGeneral(cfg, cfg.q_lora_rank, self.n_heads * self.head_dim, make, **normal)
    self.weights_proj = layers.DenseGeneral(cfg, cfg.emb_dim, self.n_heads, make, **normal)

  def __call__(self, x, q_latent, positions, rope, segment_mask):
    x, q_latent = jax.lax.stop_gradient(x), jax.lax.stop_gradient(q_latent)
    b, s, _ = x.shape
    kv, gate = self.kv_proj(x), self.gate_proj(x)
    n = s // self.ratio
    if n == 0:
      return jnp.zeros((b, s, 0), jnp.int32)
    keys = rope(overlap_pool(kv, gate, positions, self.ratio, self.position_bias, self.kv_norm),
                positions[:, : n * self.ratio: self.ratio], None)                         # [b, n, d]
    q = jnp.reshape(self.q_proj(q_latent), (b, s, self.n_heads, self.head_dim))
    q = rope(jnp.transpose(q, (0, 2, 1, 3)), positions, 1)                                  # [b, h, t, d]
    weights = self.weights_proj(x).astype(jnp.float32) * (self.n_heads ** -0.5)            # [b, t, h]
    scores = jnp.einsum("bhsd,bwd->bhsw", q.astype(jnp.float32), keys.astype(jnp.float32),
                        precision=self.precision)
    scores = jax.nn.relu(scores) * (self.head_dim ** -0.5)
    scores = jnp.einsum("bhsw,bsh->bsw", scores, weights, precision=self.precision)
    invalid = future_blocks(positions, n, self.ratio)
    scores = jnp.where(invalid, -jnp.inf, scores)
    if segment_mask is not None:
      scores = scores + segment_mask[:, :, :n]
      invalid = invalid | (segment_mask[:, :, :n] < DEFAULT_MASK_VALUE / 2)
    top = jax.lax.top_k(scores, min(self.top_k, n))[1]
    return jnp.where(jnp.take_along_axis(invalid, top, axis=-1), -1, top)


class CSACompressor(_Compressor):
  """`csa_compressor`: overlapping windows of 2r tokens, blocks chosen per query by its `indexer`."""

  def __init__(self, cfg, ratio: int, make: inits.VariableFactory):
    super().__init__(cfg, ratio, 2, cfg.head_dim, make)
    self.indexer = V4Indexer(cfg, ratio, make) if cfg.use_indexer else None
    # The indexer's dense warm-up (a loss weight without sparse training): MaxText attends to every visible block.
    self.dense_warmup = cfg.indexer_loss_scaling_factor > 0 and not cfg.indexer_sparse_training

  def __call__(self, x, q_latent, positions, rope, segment_mask):
    top = None if self.indexer is None else self.indexer(x, q_latent, positions, rope, segment_mask)
    kv, gate = self.kv_proj(x), self.gate_proj(x)
    b, s, _ = x.shape
    n = s // self.ratio
    if n > 0:
      pooled = rope(overlap_pool(kv, gate, positions, self.ratio, self.position_bias, self.kv_norm),
                    positions[:, : n * self.ratio: self.ratio], None)
    else:
      pooled = self._empty(x)
    if n == 0 or top is None or self.dense_warmup:
      mask = jnp.zeros((b, 1, s, n), self.dtype)
      if n > 0:  # no indexer (or its dense warm-up): MaxText falls back to the causal block mask
        mask = jnp.where(future_blocks(positions, n, self.ratio), DEFAULT_MASK_VALUE, 0.0).astype(self.dtype)
        mask = mask[:, None]
      return pooled[:, :, None, :], mask
    if top.shape[-1] > 0:
      chosen = jnp.any((top[..., None] == jnp.arange(n)) & (top[..., None] >= 0), axis=2)  # [b, t, n]
      mask = jnp.where(chosen, 0.0, DEFAULT_MASK_VALUE).astype(self.dtype)[:, None]
    else:
      mask = jnp.full((b, 1, s, n), DEFAULT_MASK_VALUE, self.dtype)
    return pooled[:, :, None, :], mask
