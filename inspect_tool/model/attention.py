"""Multi-head Latent Attention (MLA) with MaxText's projections and its dot-product `attention_op`.

`MLA` owns the projections (`wq_a`, `q_norm`, `wq_b` or `query`; `wkv_a`, `kv_norm`, `wkv_b`; `out`), the
parameter-free `rotary_embedding` and `attention_op`, and with `use_indexer` (DeepSeek-V3.2) the `indexer`
whose top-k selection further masks the attention logits (see `indexer`). The softmax scale is folded into the query;
`attention_op` makes exactly two `jnp.einsum` calls (qk and wv) in the compute dtype, masks with
-0.7·float32.max (causal, plus segments when given) and normalises after the value product, as
MaxText's `apply_attention_dot` does.
"""

from __future__ import annotations

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

from inspect_tool.model import indexer as indexer_lib
from inspect_tool.model import initializers as inits
from inspect_tool.model import layers
from inspect_tool.model import remat
from inspect_tool.model import rope
from inspect_tool.model import splash

DEFAULT_MASK_VALUE = -0.7 * float(np.finfo(np.dtype("float32")).max)


def allowed_keys(t: int, s: int, segment_ids=None) -> jax.Array:
  """Boolean [b or 1, t, s]: causal, and within the same (non-negative) segment when segment ids are given."""
  allowed = (jnp.arange(t)[:, None] >= jnp.arange(s)[None, :])[None]
  if segment_ids is not None:
    allowed = allowed & (segment_ids[:, :, None] == segment_ids[:, None, :]) & (segment_ids[:, None, :] >= 0)
  return allowed


class AttentionOp(nnx.Module):
  """Dot-product attention over [B, T, H, D] queries and [B, S, H_kv, D] keys / values."""

  def __init__(self, cfg):
    self.float32_qk_product = bool(cfg.float32_qk_product)
    self.precision = layers.precision(cfg)
    self.kernel = str(cfg.attention)  # on a TPU mesh, flash (and autoselected) run the splash kernel (`splash`)
    self.blocks = tuple(int(getattr(cfg, k)) for k in splash.BLOCK_KEYS)  # a tuple: graph definitions are hashed

  def __call__(self, query, key, value, segment_ids=None, keep=None, *, allowed=None, sinks=None):
    """`keep` [b, t, s] (the indexer's selection) further restricts the causal / segment mask; `allowed`
    [b, t, s] replaces that mask (DeepSeek-V4); `sinks` [n] are per-head logits that join the softmax only."""
    b, t, n, d = query.shape
    n_kv = key.shape[-2]
    if keep is None and allowed is None and sinks is None and n_kv == n and splash.applies(self.kernel, t):
      return splash.attend(query, key, value, segment_ids, self.blocks)
    if self.float32_qk_product:
      query, key = query.astype(jnp.float32), key.astype(jnp.float32)
    query = jnp.reshape(query, (b, t, n_kv, n // n_kv, d))
    logits = jnp.einsum("btkgd,bskd->bkgts", query, key, precision=self.precision)
    s = key.shape[1]
    if allowed is None:
      allowed = allowed_keys(t, s, segment_ids)
    allowed = allowed[:, None, None]
    if keep is not None:
      allowed = allowed & keep[:, None, None]
    logits = jnp.where(allowed, logits, DEFAULT_MASK_VALUE)
    logits = jnp.reshape(logits, (b, n, t, s))
    if sinks is not None:
      sink_logits = jnp.broadcast_to(sinks.astype(logits.dtype)[None, :, None, None], (b, n, t, 1))
      logits = jnp.concatenate([logits, sink_logits], axis=-1)
    local_max = jnp.max(logits, axis=-1, keepdims=True)
    exps = jnp.exp(logits - local_max)
    local_sum = jnp.transpose(jnp.sum(exps, axis=-1, keepdims=True), (0, 2, 1, 3))  # [b, t, n, 1]
    exps = exps[..., :s]
    exps = jnp.reshape(exps, (b, n_kv, n // n_kv, t, s))
    out = jnp.einsum("bkgts,bskd->btkgd", exps, value, precision=self.precision)
    out = jnp.reshape(out, (b, t, n, value.shape[-1]))
    return out / local_sum


class MLA(nnx.Module):
  """MaxText's MLA (training / full-sequence path; no KV caches)."""

  def __init__(self, cfg, make: inits.VariableFactory):
    e, h = cfg.emb_dim, cfg.num_query_heads
    self.num_heads = h
    self.q_lora_rank = cfg.q_lora_rank
    self.kv_lora_rank = cfg.kv_lora_rank
    self.nope_dim = cfg.qk_nope_head_dim
    self.softmax_scale = cfg.softmax_scale
    self.rotary_embedding = rope.YarnRotaryEmbedding(cfg)
    self.attention_op = AttentionOp(cfg)
    normal = dict(distribution="normal")
    if cfg.q_lora_rank == 0:
      self.query = layers.DenseGeneral(cfg, e, (h, cfg.qk_head_dim), make, **normal)
    else:
      self.wq_a = layers.DenseGeneral(cfg, e, cfg.q_lora_rank, make, **normal)
      self.q_norm = layers.RMSNorm(cfg, cfg.q_lora_rank, make)
      self.wq_b = layers.DenseGeneral(cfg, cfg.q_lora_rank, (h, cfg.qk_head_dim), make, **normal)
    self.wkv_a = layers.DenseGeneral(cfg, e, cfg.kv_lora_rank + cfg.qk_rope_head_dim, make, **normal)
    self.kv_norm = layers.RMSNorm(cfg, cfg.kv_lora_rank, make)
    self.wkv_b = layers.DenseGeneral(cfg, cfg.kv_lora_rank, (h, cfg.qk_nope_head_dim + cfg.v_head_dim), make,
                                     **normal)
    self.out = layers.DenseGeneral(cfg, (h, cfg.v_head_dim), e, make, **normal)
    if cfg.use_indexer:  # DeepSeek-V3.2: its own RoPE reads halves, not pairs
      indexer_rope = rope.YarnRotaryEmbedding(cfg)
      indexer_rope.interleave = False
      self.indexer = indexer_lib.Indexer(cfg, indexer_rope, make)
    else:
      self.indexer = None

  def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array | None = None) -> jax.Array:
    q_latent = None
    if self.q_lora_rank == 0:
      q = self.query(x)
    else:
      q_latent = remat.name(self.q_norm(remat.name(self.wq_a(x), "query_wa_proj")), "mla_q")
      q = self.wq_b(q_latent)
    q_nope, q_pe = jnp.split(q, [self.nope_dim], axis=-1)
    q_pe = self.rotary_embedding(q_pe, positions)
    query = jnp.concatenate([q_nope, q_pe], axis=-1) * self.softmax_scale

    low_rank = remat.name(self.wkv_a(x), "kv_wa_proj")
    c_kv, k_pe = jnp.split(low_rank, [self.kv_lora_rank], axis=-1)
    c_kv = remat.name(self.kv_norm(c_kv), "mla_kv")
    k_pe = self.rotary_embedding(jnp.expand_dims(k_pe, axis=2), positions)
    k_nope, value = jnp.split(self.wkv_b(c_kv), [self.nope_dim], axis=-1)
    k_pe = jnp.broadcast_to(k_pe, (k_nope.shape[0], k_nope.shape[1], self.num_heads, k_pe.shape[3]))
    key = jnp.concatenate([k_nope, k_pe], axis=-1)
    query, key, value = (remat.name(query, "query_proj"), remat.name(key, "key_proj"),
                         remat.name(value, "value_proj"))

    keep = None
    if self.indexer is not None:
      keep = self.indexer(x, q_latent, positions, allowed_keys(x.shape[1], x.shape[1], segment_ids))
    out = remat.name(self.attention_op(query, key, value, segment_ids, keep), "attention_out")
    return remat.name(self.out(out), "out_proj")
