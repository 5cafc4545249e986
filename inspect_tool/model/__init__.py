"""The DeepSeek-V3/V2 Flax NNX model, name for name and shape for shape MaxText 0.2.5's.

Public API (the package imports its modules, and with them JAX and Flax; the metadata listings never import it):
  - `build_model(cfg, *, abstract=True, seed=None)` → `transformer.Transformer`
  - `qwix_init_inputs(cfg)` → (args, kwargs) of the call Qwix's `quantize_model` makes
  - `Transformer.__call__(tokens, positions, segment_ids=None, *, decoder_target_tokens=None,
    decoder_target_mask=None, enable_dropout=False)` → main logits; MTP outputs stay on `mtp_block`
    as intermediates (`mtp_block.logits`, `.losses`, `.weights`; see `mtp`), read by `inspect_tool.run.forward`.
Modules: layers (RMSNorm, DenseGeneral, Embed, MlpBlock), rope (YaRN), attention (MLA, AttentionOp),
moe (GateLogit, RoutedMoE, RoutedAndSharedMoE, MoEBiasVar), decoder, mtp, transformer, initializers.
"""

from __future__ import annotations

import jax.numpy as jnp

from inspect_tool.model import transformer


def build_model(cfg, *, abstract: bool = True, seed: int | None = None):
  """See `transformer.build_model`."""
  return transformer.build_model(cfg, abstract=abstract, seed=seed)


QWIX_INIT_SEQUENCE = 16


def qwix_init_inputs(cfg) -> tuple[tuple, dict]:
  """The model call `qwix.quantize_model` makes, as MaxText's `maybe_quantize_model` does: token, position and
  segment arrays of ones, dropout off, and (with MTP) target tokens and mask so the MTP block is traced too.

  The batch is (1, min(max_target_length, 16)): which ops run and which rule each gets does not depend on it,
  except with DeepSeek-V3.2's indexer, whose scoring ops run only on more keys than `indexer_topk`; the
  sequence then grows to `indexer_topk + 1` exactly when MaxText's (max_target_length) exceeds `indexer_topk`,
  and DeepSeek-V4's compressors, which run only on a whole block (the largest `compress_ratios` entry).
  """
  length = min(cfg.max_target_length, QWIX_INIT_SEQUENCE)
  if cfg.decoder_block == "deepseek4":  # a compressor's ops run only on sequences of a whole block or more
    length = min(cfg.max_target_length, max([length] + [int(r) for r in cfg.compress_ratios]))
  elif cfg.use_indexer and cfg.max_target_length > cfg.indexer_topk >= length:
    length = cfg.indexer_topk + 1
  ones = jnp.ones((1, length), jnp.int32)
  kwargs = {"enable_dropout": False}
  if cfg.mtp_num_layers > 0:
    kwargs.update(decoder_target_tokens=ones, decoder_target_mask=ones)
  return (ones, ones, ones), kwargs
