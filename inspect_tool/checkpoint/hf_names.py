"""MaxText leaf ↔ Hugging Face DeepSeek tensor names, shared by the exporter and the reader."""

from __future__ import annotations

import math

import numpy as np

from inspect_tool.fp8_export.write_hf import (  # pylint: disable=unused-import
    BF16, BF16_LINEAR, BLOCK, EXPERTS_FP8, F32, FP8, _plan)


def leaf_plan(cfg, mtp_shared_copies: bool = True) -> dict:
  return _plan(cfg, mtp_shared_copies)


def rope_order(dr: int) -> np.ndarray:
  """HF column k of the rope part takes MaxText column rope_order[k] (`rope_interleave=false`: 2i <- i)."""
  return np.arange(dr).reshape(2, dr // 2).T.reshape(dr)


def maxtext_kernel(w_oi, rule, shape: tuple[int, ...], cfg) -> np.ndarray:
  """The MaxText kernel of per-layer `shape` (in axes..., out axes...) of an HF (out, in) Linear weight."""
  kernel = np.asarray(w_oi, np.float32).T.reshape(shape)
  if rule.rope and not cfg.rope_interleave:
    dr = cfg.qk_rope_head_dim
    start = kernel.shape[-1] - dr
    kernel = kernel.copy()
    kernel[..., start + rope_order(dr)] = kernel[..., start:].copy()
  return kernel


def synthesized_names(cfg) -> list[str]:
  """Tensors the exporter adds that MaxText lacks: the zero e_score_correction_bias without `routed_bias`."""
  if cfg.deepseek_routing and not cfg.routed_bias:
    return [f"model.layers.{i}.mlp.gate.e_score_correction_bias"
            for i in range(cfg.first_num_dense_layers, cfg.num_decoder_layers + cfg.mtp_num_layers)]
  return []


_ = math
