"""Multi-Token Prediction (MaxText 0.2.5 wheel): `mtp_block/mtp_layer_{k}/mtp_{k}_*`.

Depth k sees the previous depth's hidden state (the decoder output before `decoder_norm` for k=1) and the
embedding of the token k steps ahead, predicts the token k+1 steps ahead, and shares the embedding table
and output head (`decoder.logits_dense`, called a second time) with the main model. MTP logits go through
`mtp_{k}_final_norm`, not `decoder_norm`.

Outputs are stored on the block as intermediates (pop them with `nnx.pop(model, nnx.Intermediate)`):
`mtp_block.losses` / `mtp_block.weights` (`mtp_losses`, shape [P]: masked cross-entropy sums and token
counts, MaxText's names) and `mtp_block.logits` (`mtp_logits`, [P, B, S, V] float32).
"""

from __future__ import annotations

from flax import nnx
import jax
import jax.numpy as jnp

from inspect_tool.model import decoder as decoder_lib
from inspect_tool.model import initializers as inits
from inspect_tool.model import layers
from inspect_tool.model import partitioning

PER_TOKEN = ("activation_embed_and_logits_batch", "activation_length")  # MaxText's sharding of per-token losses
NORMED = ("activation_batch", "activation_length", "activation_embed")  # ... of the MTP head's input


class mtp_losses(nnx.Intermediate):  # pylint: disable=invalid-name
  """MaxText's intermediate collection for the per-depth MTP loss sums and weights."""


class mtp_logits(nnx.Intermediate):  # pylint: disable=invalid-name
  """Per-depth MTP logits [P, B, S, V]."""


def shift_left(x: jax.Array) -> jax.Array:
  """Left shift by one along the sequence axis; the last position becomes 0."""
  rolled = jnp.roll(x, -1, axis=1)
  last = (jnp.arange(rolled.shape[1]) == rolled.shape[1] - 1).reshape((1, -1) + (1,) * (rolled.ndim - 2))
  return jnp.where(last, 0, rolled)


def shift_left_in_segment(x: jax.Array, segment_ids: jax.Array | None) -> jax.Array:
  """`shift_left`, also zeroing positions whose next position is in another segment or whose segment is 0."""
  if segment_ids is None:
    return shift_left(x)
  boundary = (segment_ids != shift_left(segment_ids)) | (segment_ids == 0)
  return jnp.where(boundary[(...,) + (None,) * (x.ndim - 2)], 0, shift_left(x))


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
  """Per-token cross-entropy from integer labels: logsumexp(logits) - logits[label]."""
  lse = jax.scipy.special.logsumexp(logits, axis=-1, keepdims=True)
  target = jnp.take_along_axis(logits, labels[..., None].astype(jnp.int32), axis=-1)
  return jnp.squeeze(lse - target, axis=-1)


class MultiTokenPredictionLayer(nnx.Module):
  """One MTP depth: norms, concat [embedding, hidden], projection 2E→E, a DeepSeek MoE layer, final norm."""

  def __init__(self, cfg, k: int, make: inits.VariableFactory):
    self.k = k
    e = cfg.emb_dim
    setattr(self, f"mtp_{k}_embedding_norm", layers.RMSNorm(cfg, e, make))
    setattr(self, f"mtp_{k}_hidden_state_norm", layers.RMSNorm(cfg, e, make))
    setattr(self, f"mtp_{k}_projection", layers.DenseGeneral(cfg, 2 * e, e, make))
    setattr(self, f"mtp_{k}_transformer_layer", decoder_lib.DeepSeekMoELayer(cfg, make))
    setattr(self, f"mtp_{k}_final_norm", layers.RMSNorm(cfg, e, make))

  def part(self, name: str) -> nnx.Module:
    return getattr(self, f"mtp_{self.k}_{name}")

  def __call__(self, prev_hidden, target_embedding, positions, segment_ids):
    features = jnp.concatenate([self.part("embedding_norm")(target_embedding),
                                self.part("hidden_state_norm")(prev_hidden)], axis=-1)
    projected = self.part("projection")(features)
    return self.part("transformer_layer")(projected, segment_ids, positions)


class MultiTokenPredictionBlock(nnx.Module):
  """All MTP depths; holds a shared reference to the decoder (its head is reused, not copied)."""

  def __init__(self, cfg, decoder: decoder_lib.Decoder, make: inits.VariableFactory):
    self.decoder = decoder
    self.num_layers = cfg.mtp_num_layers
    for k in range(1, cfg.mtp_num_layers + 1):
      setattr(self, f"mtp_layer_{k}", MultiTokenPredictionLayer(cfg, k, make))

  def __call__(self, embedder, main_hidden, input_ids, target_ids, target_mask, positions, segment_ids):
    target_mask = (jnp.ones_like(input_ids, dtype=jnp.int32) if target_mask is None
                   else (jnp.asarray(target_mask) != 0).astype(jnp.int32))
    if target_ids is None:
      target_ids = jnp.ones_like(input_ids, dtype=jnp.int32)
    hidden = main_hidden
    ids, tgt, msk, pos, seg = input_ids, target_ids, target_mask != 0, positions, segment_ids
    losses, weights, all_logits = [], [], []
    for k in range(1, self.num_layers + 1):
      ids, tgt = shift_left_in_segment(ids, seg), shift_left_in_segment(tgt, seg)
      msk, pos = shift_left_in_segment(msk, seg), shift_left_in_segment(pos, seg)
      if seg is not None:
        seg = shift_left(seg)
      embedding = embedder(ids).astype(self.decoder.dtype)
      layer = getattr(self, f"mtp_layer_{k}")
      hidden = layer(hidden, embedding, positions, segment_ids)
      normed = partitioning.constrain(layer.part("final_norm")(hidden), NORMED)
      logits = partitioning.constrain(self.decoder.apply_output_head(embedder, normed, normalize=False),
                                      decoder_lib.LOGITS)
      xent = partitioning.constrain(cross_entropy(logits, tgt), PER_TOKEN)
      losses.append(jnp.sum(xent * msk))
      weights.append(jnp.sum(msk).astype(jnp.float32))
      all_logits.append(logits)
    self.losses = mtp_losses(jnp.stack(losses))
    self.weights = mtp_losses(jnp.stack(weights))
    self.logits = mtp_logits(jnp.stack(all_logits))
