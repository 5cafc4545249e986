"""YaRN rotary position embedding as MaxText applies it to MLA's rope dimensions (no parameters).

Frequencies are computed in float32 exactly as MaxText does, and so is the table: MaxText builds exp(i·t·f) for
every t < max_position_embeddings and reads it at the positions, and its compiled training step holds that table
(two float32 arrays of max_position_embeddings × dims/2 on TPU), so ours does the same. Pairs are read interleaved
(`rope_interleave=true`: x[2i], x[2i+1]) or split in halves, and the output is always in concatenated
layout [real parts, imaginary parts], cast to the compute dtype. All arithmetic is elementwise.
"""

from __future__ import annotations

import math

from flax import nnx
import jax
import jax.numpy as jnp

from inspect_tool import errors


def correction_range(cfg, dims: int) -> tuple[float, float]:
  """YaRN's [low, high] dimension range between the extrapolated and interpolated frequencies."""
  def corr(rotations: float) -> float:
    return dims * math.log(cfg.original_max_position_embeddings / (rotations * 2 * math.pi)) / (
        2 * math.log(cfg.rope_max_timescale))
  low, high = corr(cfg.beta_fast), corr(cfg.beta_slow)
  if cfg.rope_truncate:
    low, high = math.floor(low), math.ceil(high)
  return max(low, 0), min(high, dims - 1)


class YarnRotaryEmbedding(nnx.Module):
  """Applies YaRN RoPE to [B, S, N, dims] inputs at integer positions [B, S]."""

  def __init__(self, cfg):
    self.dims = cfg.qk_rope_head_dim
    self.rope_type = cfg.rope_type
    self.theta = float(cfg.rope_max_timescale)
    self.factor = float(cfg.rope_factor)
    self.low, self.high = correction_range(cfg, self.dims)
    self.interleave = bool(cfg.rope_interleave)
    self.attention_scaling = bool(cfg.rope_attention_scaling)
    self.dtype = jnp.dtype(cfg.dtype)
    self.max_position_embeddings = int(cfg.max_position_embeddings)

  def frequencies(self) -> jax.Array:
    half = self.dims // 2
    freqs = 1.0 / (self.theta ** (2.0 * jnp.arange(0, half, dtype=jnp.float32) / self.dims))
    low, high = self.low, self.high
    if low == high:
      high += 0.001
    ramp = jnp.clip((jnp.arange(half, dtype=jnp.float32) - low) / (high - low), 0, 1)
    smooth = 1 - ramp
    return freqs / self.factor * (1 - smooth) + freqs * smooth

  def __call__(self, inputs: jax.Array, positions: jax.Array) -> jax.Array:
    if self.rope_type != "yarn":
      raise errors.ConfigError(f"rope_type={self.rope_type!r} is not supported by this MLA forward pass; "
                               "accepted: 'yarn'")
    b, s, n, h = inputs.shape
    table = jnp.exp(1j * jnp.outer(jnp.arange(self.max_position_embeddings, dtype=jnp.float32), self.frequencies()))
    cis = table[positions.astype(jnp.int32)][:, :, None, :]  # [B, S, 1, half] complex64
    if self.interleave:
      pairs = inputs.reshape(b, s, n, h // 2, 2)
      real, imag = pairs[..., 0], pairs[..., 1]
    else:
      real, imag = jnp.split(inputs, 2, axis=-1)
    rotated = jnp.multiply(real + 1j * imag, jnp.broadcast_to(cis, (b, s, n, h // 2)))
    out = jnp.concatenate([jnp.real(rotated), jnp.imag(rotated)], axis=-1)
    if self.attention_scaling and self.factor > 1:
      out = out * (0.1 * math.log(self.factor) + 1.0)
    return out.astype(self.dtype)
