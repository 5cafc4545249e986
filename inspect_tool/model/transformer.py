"""The DeepSeek `Transformer` (MaxText's top-level NNX model) and `build_model`.

Top-level children: `token_embedder` (`embedding` (V, E)), `decoder`, and `mtp_block` when
`mtp_num_layers > 0` (it shares the decoder by reference, so its head and the embedding are not duplicated).
No RNG state is stored in the model: dropout is off (rate 0) and initialisation draws from a seed at build.
"""

from __future__ import annotations

from flax import nnx
import jax.numpy as jnp

from inspect_tool.model import decoder as decoder_lib
from inspect_tool.model import deepseek4
from inspect_tool.model import initializers as inits
from inspect_tool.model import layers
from inspect_tool.model import mtp


class Transformer(nnx.Module):
  """tokens → main logits (B, S, V) float32; MTP outputs are left on `mtp_block` (see `mtp`)."""

  def __init__(self, cfg, make: inits.VariableFactory):
    self.config = cfg
    self.token_embedder = layers.Embed(cfg, make)
    decoder_class = deepseek4.Decoder if cfg.decoder_block == "deepseek4" else decoder_lib.Decoder
    self.decoder = decoder_class(cfg, make)
    self.mtp_block = (mtp.MultiTokenPredictionBlock(cfg, self.decoder, make) if cfg.mtp_num_layers > 0
                      else None)
    self.skip_mtp = False

  def __call__(self, decoder_input_tokens, decoder_positions, decoder_segment_ids=None, *,
               decoder_target_tokens=None, decoder_target_mask=None, enable_dropout=False, model_mode="train"):
    """MaxText's signature (dropout has rate 0 here, so `enable_dropout` changes nothing).

    `skip_mtp` (an attribute, False by default) stops before the MTP block: the coverage trace of a model whose
    MTP layer MaxText builds but cannot run (`validation.forward_failure`) records what runs before it.
    """
    del enable_dropout, model_mode
    tokens = jnp.asarray(decoder_input_tokens).astype(jnp.int32)
    logits, hidden = self.decoder(self.token_embedder, tokens, decoder_positions, decoder_segment_ids)
    if self.mtp_block is not None and not self.skip_mtp:
      self.mtp_block(self.token_embedder, hidden, tokens, decoder_target_tokens, decoder_target_mask,
                     decoder_positions, decoder_segment_ids)
    return logits


def build_model(cfg, *, abstract: bool = True, seed: int | None = None) -> Transformer:
  """Builds the model for `cfg`.

  Args:
    cfg: a `ModelConfig`.
    abstract: True → every variable holds a `jax.ShapeDtypeStruct` (nothing allocated, nothing traced);
      False → random weights (see `initializers`).
    seed: initialisation seed for a real model (default `cfg.init_weights_seed`).
  """
  if abstract:
    seed = None
  elif seed is None:
    seed = cfg.init_weights_seed
  factory = inits.VariableFactory(weight_dtype=cfg.weight_dtype, param_scan_axis=cfg.param_scan_axis, seed=seed)
  return Transformer(cfg, factory)
