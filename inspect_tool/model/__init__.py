"""The DeepSeek-V3/V2 Flax NNX model, name for name and shape for shape MaxText 0.2.5's.

Public API (submodules import JAX/Flax; this package's import does not):
  - `build_model(cfg, *, abstract=True, seed=None)` → `transformer.Transformer`
  - `Transformer.__call__(tokens, positions, segment_ids=None, *, decoder_target_tokens=None,
    decoder_target_mask=None, enable_dropout=False)` → main logits; MTP outputs stay on `mtp_block`
    as intermediates (`mtp_block.logits`, `.losses`, `.weights`; see `mtp`), read by `inspect_tool.forward`.
Modules: layers (RMSNorm, DenseGeneral, Embed, MlpBlock), rope (YaRN), attention (MLA, AttentionOp),
moe (GateLogit, RoutedMoE, RoutedAndSharedMoE, MoEBiasVar), decoder, mtp, transformer, initializers.
"""

from __future__ import annotations


def build_model(cfg, *, abstract: bool = True, seed: int | None = None):
  """See `transformer.build_model`."""
  from inspect_tool.model import transformer  # pylint: disable=import-outside-toplevel

  return transformer.build_model(cfg, abstract=abstract, seed=seed)
