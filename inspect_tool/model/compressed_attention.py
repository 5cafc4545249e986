"""DeepSeek-V4's compressed attention (`self_attention` of a `deepseek4` layer), MaxText 0.2.5's training path.

Parameters: `wq_a` (E, q_lora), `q_norm`, `wq_b` (q_lora, H, D), `wkv` (E, 1, D), `kv_norm`, `sinks` (H,),
`o_a_proj` (G, H·D/G, o_lora: one matmul per group), `o_b_proj` (G·o_lora, E), and per `compress_ratio` an
`hca_compressor` (> 4) or a `csa_compressor` (4; see `compressors`). Letters: b batch, t query, s key, h head,
d head dim, g group.

  q = RoPE(rms(wq_b(q_norm(wq_a(x))))) · D^-½        (rms: RMS normalisation without a scale)
  kv = RoPE(kv_norm(wkv(x)))                           one key = value head shared by all heads
  keys = [kv | compressed blocks]; query t sees kv within `sliding_window_size` before it (causal) and the
  blocks the compressor allows; a learned per-head sink logit joins the softmax (it takes probability mass,
  adds no value)
  out = o_b_proj(o_a_proj(RoPE⁻¹(attention) grouped))

RoPE here is DeepSeek-V4's: interleaved pairs on the last `qk_rope_head_dim` dims, theta
`compressed_rope_max_timescale` in layers with a compressor, `rope_max_timescale` otherwise. Ops Qwix sees:
the projections' `dot_general`s, the norms' einsums, `o_a_proj`'s einsum and `attention_op`'s two einsums.
"""

from __future__ import annotations

from flax import nnx
import jax
import jax.numpy as jnp

from inspect_tool.model import attention
from inspect_tool.model import compressors
from inspect_tool.model import initializers as inits
from inspect_tool.model import layers

DEFAULT_MASK_VALUE = compressors.DEFAULT_MASK_VALUE


class V4Rope(nnx.Module):
  """Interleaved partial RoPE: rotates pairs (2i, 2i+1) of the last `dims` channels; no parameters."""

  def __init__(self, dims: int, theta: float):
    self.dims = dims
    self.theta = float(theta)

  def __call__(self, x: jax.Array, positions: jax.Array, unsqueeze_dim: int | None, reverse: bool = False):
    inv_freq = 1.0 / (self.theta ** (2 * jnp.arange(0, self.dims // 2, dtype=jnp.float32) / self.dims))
    angles = positions[:, :, None].astype(jnp.float32) * inv_freq[None, None, :]
    cos = jnp.repeat(jnp.cos(angles), 2, axis=-1)
    sin = jnp.repeat(jnp.sin(angles), 2, axis=-1)
    if reverse:
      sin = -sin
    if unsqueeze_dim is not None:
      cos, sin = jnp.expand_dims(cos, unsqueeze_dim), jnp.expand_dims(sin, unsqueeze_dim)
    nope, rot = x[..., :-self.dims], x[..., -self.dims:].astype(jnp.float32)
    swapped = jnp.stack((-rot[..., 1::2], rot[..., 0::2]), axis=-1).reshape(rot.shape)
    return jnp.concatenate([nope, (rot * cos + swapped * sin).astype(x.dtype)], axis=-1)


def rms(x: jax.Array, epsilon: float, dtype) -> jax.Array:
  """RMS normalisation without a scale (MaxText's `RMSNorm(with_scale=False)`): no op Qwix sees."""
  x = jnp.asarray(x, jnp.float32)
  return jnp.asarray(x * jax.lax.rsqrt(jnp.mean(jax.lax.square(x), axis=-1, keepdims=True) + epsilon), dtype)


class GroupedLinear(nnx.Module):
  """`o_a_proj`: [..., G, I] @ kernel (G, I, O) per group, one einsum."""

  def __init__(self, cfg, groups: int, in_per_group: int, out_per_group: int, make: inits.VariableFactory):
    self.dtype = layers.compute_dtype(cfg)
    self.precision = layers.precision(cfg)
    self.kernel = make.make((groups, in_per_group, out_per_group), inits.dense((1,)))

  def __call__(self, x: jax.Array) -> jax.Array:
    kernel = layers.kernel_value(self.kernel, self.dtype)
    return jnp.einsum("...gi,gio->...go", jnp.asarray(x, self.dtype), kernel, precision=self.precision)


class CompressedAttention(nnx.Module):
  """MaxText's `CompressedAttention` for one `compress_ratio` (0: sliding window only)."""

  def __init__(self, cfg, ratio: int, make: inits.VariableFactory):
    e, h, d = cfg.emb_dim, cfg.num_query_heads, cfg.head_dim
    self.ratio = ratio
    self.num_heads, self.head_dim = h, d
    self.groups = cfg.o_groups
    self.window = cfg.sliding_window_size or None
    self.epsilon = float(cfg.normalization_layer_epsilon)
    self.dtype = layers.compute_dtype(cfg)
    normal = dict(distribution="normal")
    self.wq_a = layers.DenseGeneral(cfg, e, cfg.q_lora_rank, make, **normal)
    self.q_norm = layers.RMSNorm(cfg, cfg.q_lora_rank, make)
    self.wq_b = layers.DenseGeneral(cfg, cfg.q_lora_rank, (h, d), make, **normal)
    self.wkv = layers.DenseGeneral(cfg, e, (cfg.num_kv_heads, d), make, **normal)
    self.kv_norm = layers.RMSNorm(cfg, d, make)
    theta = cfg.compressed_rope_max_timescale if ratio > 0 else cfg.rope_max_timescale
    self.rotary_embedding = V4Rope(int(d * (cfg.qk_rope_head_dim / d)), theta)
    self.hca_compressor = compressors.HCACompressor(cfg, ratio, make) if ratio > 4 else None
    self.csa_compressor = compressors.CSACompressor(cfg, ratio, make) if ratio == 4 else None
    self.sinks = make.make((h,), inits.zeros)
    self.o_a_proj = GroupedLinear(cfg, cfg.o_groups, h * d // cfg.o_groups, cfg.o_lora_rank, make)
    self.o_b_proj = layers.DenseGeneral(cfg, cfg.o_groups * cfg.o_lora_rank, e, make, **normal)
    self.attention_op = attention.AttentionOp(cfg)

  def _compressed_segments(self, segment_ids, n_blocks: int):
    """Segment id per block (-1 when a block straddles two segments) and the additive [b, t, n] mask."""
    b = segment_ids.shape[0]
    blocks = jnp.reshape(segment_ids[:, : n_blocks * self.ratio], (b, n_blocks, self.ratio))
    low, high = jnp.min(blocks, axis=-1), jnp.max(blocks, axis=-1)
    block_ids = jnp.where(low == high, low, -1)
    same = (segment_ids[:, :, None] == block_ids[:, None, :]) & (block_ids[:, None, :] >= 0)
    return block_ids, jnp.where(same, 0.0, DEFAULT_MASK_VALUE)

  def _allowed(self, t: int, segment_ids, block_ids, compressed_mask) -> jax.Array:
    """Boolean [b or 1, t, t + n]: the sliding causal window over kv, then the blocks the mask allows."""
    distance = jnp.arange(t)[:, None] - jnp.arange(t)[None, :]
    local = (distance >= 0) if self.window is None else (distance >= 0) & (distance < self.window)
    local = local[None]
    if segment_ids is not None:
      local = local & (segment_ids[:, :, None] == segment_ids[:, None, :]) & (segment_ids[:, None, :] >= 0)
    if compressed_mask is None:
      return local
    blocks = compressed_mask[:, 0] >= DEFAULT_MASK_VALUE * 0.5                                # [b, t, n]
    if segment_ids is not None:
      blocks = blocks & (segment_ids[:, :, None] == block_ids[:, None, :]) & (block_ids[:, None, :] >= 0)
    local = jnp.broadcast_to(local, blocks.shape[:1] + local.shape[1:])
    return jnp.concatenate([local, blocks], axis=-1)

  def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array | None = None) -> jax.Array:
    rope = self.rotary_embedding
    q_latent = self.q_norm(self.wq_a(x))
    q = rope(rms(self.wq_b(q_latent), self.epsilon, self.dtype), positions, -2) * (self.head_dim ** -0.5)
    kv = rope(self.kv_norm(self.wkv(x)), positions, -2)
    n_blocks = x.shape[1] // self.ratio if self.ratio else 0
    block_ids = segment_mask = None
    if segment_ids is not None and self.ratio > 0:
      block_ids, segment_mask = self._compressed_segments(segment_ids, n_blocks)
    compressed_kv = compressed_mask = None
    if self.hca_compressor is not None:
      compressed_kv, compressed_mask = self.hca_compressor(x, positions, rope)
    elif self.csa_compressor is not None:
      compressed_kv, compressed_mask = self.csa_compressor(x, q_latent, positions, rope, segment_mask)
    if segment_mask is not None and compressed_mask is not None:
      compressed_mask = compressed_mask + segment_mask[:, None, :, : compressed_mask.shape[-1]]
    keys = kv if compressed_kv is None else jnp.concatenate([kv, compressed_kv], axis=1)
    allowed = self._allowed(x.shape[1], segment_ids, block_ids, compressed_mask)
    out = self.attention_op(q, keys, keys, allowed=allowed, sinks=self.sinks[...])
    out = rope(out, positions, -2, reverse=True)
    b, s, h, d = out.shape
    grouped = self.o_a_proj(jnp.reshape(out, (b, s, self.groups, h * d // self.groups)))
    return self.o_b_proj(jnp.reshape(grouped, (b, s, -1)))
