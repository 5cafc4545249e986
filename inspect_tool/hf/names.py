"""MaxText leaf ↔ Hugging Face DeepSeek tensor names: one mapping for the exporter and the reader.

`leaf_plan(cfg)` gives, for every leaf of `cfg`'s model (keyed as `params.param_leaves` keys it), the HF tensor
name(s), how the values convert and, for a scanned stack, the HF layer of each slice. DeepSeek-V3 routing exports
as `DeepseekV3ForCausalLM`, plain softmax top-k without bias as `DeepseekV2ForCausalLM`.

Letters: E emb_dim, H heads, qr/kr q/kv LoRA ranks, dn/dr/dv nope/rope/value head dims, dq = dn+dr,
F mlp_dim, Fm moe_mlp_dim, S shared experts, X experts, V vocab, L decoder layers, D dense layers,
M = L-D MoE layers, P MTP depths.

* A Linear kernel (in axes..., out axes...) is the HF weight (out, in) (`hf_matrix` / `maxtext_kernel`).
* MTP depth k is layer `L + k - 1` (`model.layers.61` for V3): enorm, hnorm, eh_proj, shared_head.norm and its
  MoE transformer layer. MaxText shares embedding and head with the main model; DeepSeek's release nevertheless
  stores copies as `model.layers.{L+k-1}.embed_tokens.weight` / `.shared_head.head.weight`, which serving
  loaders read: they are extra names of the embedding and head leaves (`mtp_shared_copies`).
* Rope columns are in Hugging Face's interleaved layout: identity for `rope_interleave=true` (MaxText consumes
  HF's layout as is); for `rope_interleave=false` MaxText pairs (i, i+dr/2), which is HF's (2i, 2i+1).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from inspect_tool.paramtree import tree

BLOCK = (128, 128)  # DeepSeek-V3's FP8 weight blocks (weight_block_size)

# How a leaf becomes Hugging Face tensors.
FP8 = "fp8"  # Linear kernel -> (out, in) float8_e4m3fn + <name>_scale_inv
EXPERTS_FP8 = "experts_fp8"  # (X, in, out) -> X Linear weights, one per expert
BF16_LINEAR = "bf16_linear"  # kernel (in, out) -> (out, in) bfloat16
BF16 = "bf16"  # as is, bfloat16 (norms, embedding)
F32 = "f32"  # as is, float32 (router bias)
F32_LINEAR = "f32_linear"  # kernel (in, out) -> (out, in) float32 (DeepSeek-V4's `hc_head_fn`)

_MOE = ("DeepSeekMoeBlock_0",)
_ROUTED = _MOE + ("MoeBlock_0",)


@dataclasses.dataclass(frozen=True)
class Rule:
  """One per-layer (or top-level) leaf: target name(s), conversion, number of input axes, rope columns."""

  names: tuple[str, ...]  # `{i}` = HF layer index, `{j}` = expert
  kind: str
  n_in: int = 1  # leading kernel axes that are the Linear's input
  rope: bool = False  # the last dr output columns are rope (of each head's dq for q; of kr+dr for kv_a)
  part: int = -1  # DeepSeek-V4's mHC: which of the three parts of one HF tensor (pre, post, res) the leaf is


@dataclasses.dataclass(frozen=True)
class Entry:
  """A MaxText leaf: its full shape, the HF layer of each stacked slice, the layer axis and its rule."""

  shape: tuple[int, ...]
  rule: Rule
  layers: tuple[int, ...] = ()  # HF layer index per slice; () for a top-level tensor
  layer_axis: int | None = None  # None: one layer, not stacked


def layer_rules(cfg, moe: bool) -> dict[tuple[str, ...], tuple[tuple[int, ...], Rule]]:
  """Per-layer MaxText subpath -> (per-layer shape, rule), for a dense or a MoE decoder layer."""
  e, h, dn, dr, dv = cfg.emb_dim, cfg.num_query_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
  qr, kr = cfg.q_lora_rank, cfg.kv_lora_rank
  p = "model.layers.{i}."
  rules = {
      ("pre_self_attention_layer_norm", "scale"): ((e,), Rule((p + "input_layernorm.weight",), BF16)),
      ("post_self_attention_layer_norm", "scale"): ((e,), Rule((p + "post_attention_layernorm.weight",), BF16)),
      ("self_attention", "wkv_a", "kernel"): ((e, kr + dr), Rule((p + "self_attn.kv_a_proj_with_mqa.weight",),
                                                                  FP8, rope=True)),
      ("self_attention", "kv_norm", "scale"): ((kr,), Rule((p + "self_attn.kv_a_layernorm.weight",), BF16)),
      ("self_attention", "wkv_b", "kernel"): ((kr, h, dn + dv), Rule((p + "self_attn.kv_b_proj.weight",), FP8)),
      ("self_attention", "out", "kernel"): ((h, dv, e), Rule((p + "self_attn.o_proj.weight",), FP8, n_in=2)),
  }
  if qr:
    rules[("self_attention", "wq_a", "kernel")] = ((e, qr), Rule((p + "self_attn.q_a_proj.weight",), FP8))
    rules[("self_attention", "q_norm", "scale")] = ((qr,), Rule((p + "self_attn.q_a_layernorm.weight",), BF16))
    rules[("self_attention", "wq_b", "kernel")] = ((qr, h, dn + dr), Rule((p + "self_attn.q_b_proj.weight",), FP8,
                                                                           rope=True))
  else:
    rules[("self_attention", "query", "kernel")] = ((e, h, dn + dr), Rule((p + "self_attn.q_proj.weight",), FP8,
                                                                           rope=True))
  if cfg.use_indexer:  # DeepSeek-V3.2's lightning indexer, in its release's names (weights_proj kept unquantized)
    hi, di, ix = cfg.indexer_n_heads, cfg.indexer_head_dim, ("self_attention", "indexer")
    rules[ix + ("wq_b", "kernel")] = ((qr, hi, di), Rule((p + "self_attn.indexer.wq_b.weight",), FP8))
    rules[ix + ("wk", "kernel")] = ((e, di), Rule((p + "self_attn.indexer.wk.weight",), FP8))
    rules[ix + ("k_norm", "scale")] = ((di,), Rule((p + "self_attn.indexer.k_norm.weight",), BF16))
    rules[ix + ("k_norm", "bias")] = ((di,), Rule((p + "self_attn.indexer.k_norm.bias",), BF16))
    rules[ix + ("weights_proj", "kernel")] = ((e, hi), Rule((p + "self_attn.indexer.weights_proj.weight",),
                                                            BF16_LINEAR))
  projections = (("wi_0", "gate_proj"), ("wi_1", "up_proj"), ("wo", "down_proj"))
  if not moe:
    f = cfg.mlp_dim
    for mt, hf in projections:
      rules[("mlp", mt, "kernel")] = ((e, f) if mt != "wo" else (f, e), Rule((p + f"mlp.{hf}.weight",), FP8))
    return rules
  x, fm, width = cfg.num_experts, cfg.moe_mlp_dim, cfg.shared_experts * cfg.moe_mlp_dim
  rules[_ROUTED + ("gate", "kernel")] = ((e, x), Rule((p + "mlp.gate.weight",), BF16_LINEAR))
  if cfg.routed_bias:
    rules[_ROUTED + ("gate", "bias")] = ((x,), Rule((p + "mlp.gate.e_score_correction_bias",), F32))
  for mt, hf in projections:
    rules[_ROUTED + (mt,)] = ((x, e, fm) if mt != "wo" else (x, fm, e),
                              Rule((p + "mlp.experts.{j}." + f"{hf}.weight",), EXPERTS_FP8))
    if width:
      rules[_MOE + ("shared_experts", mt, "kernel")] = (
          (e, width) if mt != "wo" else (width, e), Rule((p + f"mlp.shared_experts.{hf}.weight",), FP8))
  return rules


def _stack_key(module_path: tuple[str, ...], cfg) -> tuple[str, ...]:
  """Leaf key of a layer variable: `MoEBiasVar` gate bias under nnx_aux (DeepSeek-V3 names), else params."""
  if module_path[-2:] == ("gate", "bias") and cfg.deepseek_routing:
    return tree.aux_key(module_path)
  return tree.param_key(module_path)


def leaf_plan(cfg, mtp_shared_copies: bool = True) -> dict[tuple[str, ...], Entry]:
  """Every MaxText leaf `cfg`'s model has, keyed as `params.param_leaves` keys it, with its export rule."""
  e, v, big_l, d = cfg.emb_dim, cfg.vocab_size, cfg.num_decoder_layers, cfg.first_num_dense_layers
  mtp_layers = [big_l + k - 1 for k in range(1, cfg.mtp_num_layers + 1)]
  copies = mtp_layers if mtp_shared_copies else []
  embed_names = ("model.embed_tokens.weight",) + tuple(f"model.layers.{i}.embed_tokens.weight" for i in copies)
  head_names = tuple(f"model.layers.{i}.shared_head.head.weight" for i in copies)
  if cfg.logits_via_embedding:  # tied head: HF reuses embed_tokens (tie_word_embeddings)
    embed_names += head_names
  plan = {
      tree.param_key(("token_embedder", "embedding")): Entry((v, e), Rule(embed_names, BF16)),
      tree.param_key(("decoder", "decoder_norm", "scale")): Entry((e,), Rule(("model.norm.weight",), BF16)),
  }
  if not cfg.logits_via_embedding:
    plan[tree.param_key(("decoder", "logits_dense", "kernel"))] = Entry(
        (e, v), Rule(("lm_head.weight",) + head_names, BF16_LINEAR))

  def add_layers(prefix: tuple[str, ...], moe: bool, hf_layers: list[int], stacked: bool) -> None:
    for sub, (shape, rule) in layer_rules(cfg, moe).items():
      key = _stack_key(prefix + sub, cfg)
      if not stacked:
        plan[key] = Entry(shape, rule, tuple(hf_layers))
        continue
      axis = 0 if key[:2] == tree.AUX_PREFIX else min(cfg.param_scan_axis, len(shape))
      plan[key] = Entry(shape[:axis] + (len(hf_layers),) + shape[axis:], rule, tuple(hf_layers), axis)

  m = cfg.num_moe_layers
  if cfg.scan_layers:
    if d:
      add_layers(("decoder", "dense_layers"), False, list(range(d)), True)
    if m:
      add_layers(("decoder", "moe_layers"), True, list(range(d, big_l)), True)
  else:
    for i in range(d):
      add_layers(("decoder", f"dense_layers_{i}"), False, [i], False)
    for j in range(m):
      add_layers(("decoder", f"moe_layers_{j}"), True, [d + j], False)
  for k, i in enumerate(mtp_layers, start=1):
    mtp = ("mtp_block", f"mtp_layer_{k}")
    for name, hf in (("embedding_norm", "enorm"), ("hidden_state_norm", "hnorm"),
                     ("final_norm", "shared_head.norm")):
      plan[tree.param_key(mtp + (f"mtp_{k}_{name}", "scale"))] = Entry(
          (e,), Rule((f"model.layers.{i}.{hf}.weight",), BF16))
    plan[tree.param_key(mtp + (f"mtp_{k}_projection", "kernel"))] = Entry(
        (2 * e, e), Rule((f"model.layers.{i}.eh_proj.weight",), BF16_LINEAR))
    add_layers(mtp + (f"mtp_{k}_transformer_layer",), True, [i], False)
  return plan


def rope_order(dr: int) -> np.ndarray:
  """HF rope column k holds MaxText's column rope_order[k] for `rope_interleave=false` (2i <- i, 2i+1 <- i+dr/2)."""
  return np.arange(dr).reshape(2, dr // 2).T.reshape(dr)


def kernel_matrix(kernel, rule: Rule, cfg) -> np.ndarray:
  """MaxText kernel (in axes..., out axes...) as a float32 (in, out) matrix, rope columns in HF's layout: the
  transpose of the HF Linear weight (`hf_matrix`)."""
  kernel = np.asarray(kernel, np.float32)
  if rule.rope and not cfg.rope_interleave:
    dr = cfg.qk_rope_head_dim
    start = kernel.shape[-1] - dr
    kernel = np.concatenate([kernel[..., :start], kernel[..., start + rope_order(dr)]], axis=-1)
  return kernel.reshape(math.prod(kernel.shape[:rule.n_in]), -1)


def hf_matrix(kernel, rule: Rule, cfg) -> np.ndarray:
  """MaxText kernel (in axes..., out axes...) as a float32 HF Linear weight (out, in), rope in HF layout."""
  return np.ascontiguousarray(kernel_matrix(kernel, rule, cfg).T)


def maxtext_kernel(w_oi, rule: Rule, shape: tuple[int, ...], cfg, stored_interleaved: bool = True) -> np.ndarray:
  """The MaxText kernel of per-layer `shape` of an HF (out, in) Linear weight: `hf_matrix` undone.

  `stored_interleaved`: the rope columns are stored in HF's interleaved layout (config.json `rope_interleave`,
  true unless it says false); otherwise they are stored in halves, which is MaxText's `rope_interleave=false`.
  """
  kernel = np.asarray(w_oi, np.float32).T.reshape(shape)
  if rule.rope and stored_interleaved != bool(cfg.rope_interleave):
    dr = cfg.qk_rope_head_dim
    start = kernel.shape[-1] - dr
    kernel = kernel.copy()
    if stored_interleaved:  # interleaved pairs (2i, 2i+1) -> halves (i, i + dr/2)
      kernel[..., start + rope_order(dr)] = kernel[..., start:].copy()
    else:  # halves -> interleaved
      kernel[..., start:] = kernel[..., start + rope_order(dr)].copy()
  return kernel


def synthesized_names(cfg) -> list[str]:
  """Tensors Hugging Face needs that MaxText lacks: a zero e_score_correction_bias per MoE and MTP layer for
  DeepSeek-V3 routing without `routed_bias` (MaxText then adds nothing, which a zero bias reproduces)."""
  if cfg.deepseek_routing and not cfg.routed_bias:
    return [f"model.layers.{i}.mlp.gate.e_score_correction_bias"
            for i in range(cfg.first_num_dense_layers, cfg.num_decoder_layers + cfg.mtp_num_layers)]
  return []
