"""MaxText `deepseek4` leaf ↔ DeepSeek-V4 Hugging Face tensor names: MaxText 0.2.5's V4 mapping
(`checkpoint_conversion/utils/param_mapping.py`, DEEPSEEK_V4_MAXTEXT_TO_HF_PARAM_MAPPING and its hooks), read and
written by the same `hf_names.Entry` / `Rule` records as DeepSeek-V3's names.

Names are the release's (`layers.{i}.attn.wq_a.weight`, `embed.weight`, `head.weight`, `hc_head_fn`, ...;
`spelling="release"`). transformers 5.24's `save_pretrained` of a `DeepseekV4ForCausalLM` writes the same names
under `model.` with its own top-level ones (`model.embed_tokens.weight`, `model.norm.weight`, `model.hc_head.hc_fn`,
`head.weight`: `spelling="transformers"`); `spelling_of(table)` tells them apart, and both read the same.

How each leaf converts (letters: E emb, H heads, D head_dim, G o_groups, O o_lora_rank, I = H·D/G, k mHC streams):
* Linear kernels (in..., out...) ↔ HF (out, in) weights (`FP8`: quantized in the release, 128×128 ue8m0 blocks;
  `BF16_LINEAR`: the router, the compressors' and the indexer's kv/gate projections and `weights_proj`, which the
  release keeps in bf16; `F32_LINEAR`: `hc_head_fn`). Routed experts (X, in, out) ↔ one HF weight per expert
  (`EXPERTS_FP8`; FP4 in the release).
* `o_a_proj` (G, I, O) ↔ `attn.wo_a.weight` (G·O, I) (`GROUPED_FP8`): group g's rows g·O … g·O+O-1.
* mHC: `hc_{attn,ffn}_fn` ((2+k)·k, k·E) rows [0, k), [k, 2k), [2k, 2k+k²) are `pre_alpha`, `post_alpha`,
  `res_alpha` transposed (`MHC_FN`); `hc_*_base` the betas in the same order, `res_beta` as k×k (`MHC_BASE`);
  `hc_*_scale` (3,) the three `*_alpha_scale` (`MHC_SCALE`). The release's mHC input norm has no weight: MaxText's
  `mhc_norm.scale` is read as ones (`ONES`) and must be ones to export (or is folded into the alphas: `write_v4`).
* `compressor.ape` is `position_bias`; `attn_sink` is `sinks`; `ffn.gate.bias` the gate bias (float32), and a hash
  layer's `ffn.gate.tid2eid` the token → experts table (`TABLE`: integers, float32 in MaxText).
* Layer i is `decoder/layers_i`, or, scanned, `layers_i` for the hash layers and `scanned_blocks/layers_0` (HCA) /
  `layers_1` (CSA) for the layers after them, alternately (MaxText's `DeepSeek4ScannableBlock`).
"""

from __future__ import annotations

from typing import Any, Iterable

import numpy as np

from inspect_tool.hf import names as hf_names
from inspect_tool.hf.names import BF16, BF16_LINEAR, EXPERTS_FP8, F32, F32_LINEAR, FP8, Entry, Rule
from inspect_tool.paramtree import tree

GROUPED_FP8 = "grouped_fp8"  # o_a_proj (G, I, O) -> (G*O, I), quantized in the release
MHC_FN, MHC_BASE, MHC_SCALE = "mhc_fn", "mhc_base", "mhc_scale"  # one part (Rule.part) of an mHC tensor
ONES = "ones"  # no HF tensor: MaxText's mhc_norm scale, ones
TABLE = "table"  # integer table (tid2eid), float32 in MaxText
MHC_KINDS = (MHC_FN, MHC_BASE, MHC_SCALE)
MTP_PREFIXES = ("mtp.", "model.mtp.")
SCANNED = (128, 4)  # scanned_blocks/layers_0 is HCA (ratio 128), layers_1 CSA (4)
# transformers' save_pretrained spelling of the release's top-level names (layers go under `model.`).
_TRANSFORMERS_TOP = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
                     "hc_head_fn": "model.hc_head.hc_fn", "hc_head_base": "model.hc_head.hc_base",
                     "hc_head_scale": "model.hc_head.hc_scale", "head.weight": "head.weight"}


def spelling_of(table: Iterable[str]) -> str:
  """"transformers" when the tensors are under `model.` (transformers' save_pretrained), else "release"."""
  return "transformers" if any(name.startswith(("model.layers.", "model.embed_tokens.")) for name in table) else \
      "release"


def _spelled(name: str, spelling: str) -> str:
  if spelling == "release":
    return name
  return _TRANSFORMERS_TOP.get(name) or ("model." + name if name.startswith("layers.") else name)


def layer_type(cfg, i: int) -> int:
  """Layer i's compress ratio (0: sliding window only, 4: CSA, > 4: HCA)."""
  return int(cfg.compress_ratios[i])


def scannable(ratios: list[int], hash_layers: int) -> bool:
  """Whether MaxText's scanned tree holds exactly these layers: after the hash layers, (HCA 128, CSA 4) pairs."""
  rest = ratios[hash_layers:]
  return len(rest) % 2 == 0 and all(r == SCANNED[j % 2] for j, r in enumerate(rest))


def _compressor(prefix: str, ratio: int, width: int, head_dim: int, e: int, hf: str):
  return {
      prefix + ("kv_proj", "kernel"): ((e, width * head_dim), Rule((hf + "wkv.weight",), BF16_LINEAR)),
      prefix + ("gate_proj", "kernel"): ((e, width * head_dim), Rule((hf + "wgate.weight",), BF16_LINEAR)),
      prefix + ("kv_norm", "scale"): ((head_dim,), Rule((hf + "norm.weight",), BF16)),
      prefix + ("position_bias",): ((ratio, width * head_dim), Rule((hf + "ape",), F32)),
  }


def layer_rules(cfg, ratio: int, hashed: bool) -> dict[tuple[str, ...], tuple[tuple[int, ...], Rule]]:
  """Per-layer MaxText subpath -> (per-layer shape, rule) of a V4 layer with this compress ratio."""
  e, h, d, qr = cfg.emb_dim, cfg.num_query_heads, cfg.head_dim, cfg.q_lora_rank
  g, o, k = cfg.o_groups, cfg.o_lora_rank, cfg.mhc_expansion_rate
  x, f, width = cfg.num_experts, cfg.moe_mlp_dim, cfg.shared_experts * cfg.moe_mlp_dim
  p = "layers.{i}."
  a = ("self_attention",)
  rules = {
      ("pre_self_attention_layer_norm", "scale"): ((e,), Rule((p + "attn_norm.weight",), BF16)),
      ("post_self_attention_layer_norm", "scale"): ((e,), Rule((p + "ffn_norm.weight",), BF16)),
      a + ("wq_a", "kernel"): ((e, qr), Rule((p + "attn.wq_a.weight",), FP8)),
      a + ("q_norm", "scale"): ((qr,), Rule((p + "attn.q_norm.weight",), BF16)),
      a + ("wq_b", "kernel"): ((qr, h, d), Rule((p + "attn.wq_b.weight",), FP8)),
      a + ("wkv", "kernel"): ((e, cfg.num_kv_heads, d), Rule((p + "attn.wkv.weight",), FP8)),
      a + ("kv_norm", "scale"): ((d,), Rule((p + "attn.norm.weight",), BF16)),
      a + ("sinks",): ((h,), Rule((p + "attn.attn_sink",), F32)),
      a + ("o_a_proj", "kernel"): ((g, h * d // g, o), Rule((p + "attn.wo_a.weight",), GROUPED_FP8)),
      a + ("o_b_proj", "kernel"): ((g * o, e), Rule((p + "attn.wo_b.weight",), FP8)),
  }
  for module, hf in (("mhc_attention", "hc_attn"), ("mhc_mlp", "hc_ffn")):
    rules[(module, "mhc_norm", "scale")] = ((k * e,), Rule((), ONES))
    for part, name in enumerate(("pre", "post", "res")):
      rules[(module, f"{name}_alpha")] = ((k * e, k * k if part == 2 else k), Rule((p + f"{hf}_fn",), MHC_FN,
                                                                                   part=part))
      rules[(module, f"{name}_beta")] = ((k, k) if part == 2 else (k,), Rule((p + f"{hf}_base",), MHC_BASE, part=part))
      rules[(module, f"{name}_alpha_scale")] = ((1,), Rule((p + f"{hf}_scale",), MHC_SCALE, part=part))
  if ratio > 4:
    rules |= _compressor(a + ("hca_compressor",), ratio, 1, d, e, p + "attn.compressor.")
  elif ratio == 4:
    csa = a + ("csa_compressor",)
    rules |= _compressor(csa, ratio, 2, d, e, p + "attn.compressor.")
    di, hi = cfg.indexer_head_dim, cfg.indexer_n_heads
    rules |= _compressor(csa + ("indexer",), ratio, 2, di, e, p + "attn.indexer.compressor.")
    rules[csa + ("indexer", "q_proj", "kernel")] = ((qr, hi * di), Rule((p + "attn.indexer.wq_b.weight",), FP8))
    rules[csa + ("indexer", "weights_proj", "kernel")] = ((e, hi), Rule((p + "attn.indexer.weights_proj.weight",),
                                                                         BF16_LINEAR))
  routed = ("mlp", "MoeBlock_0")
  rules[routed + ("gate", "kernel")] = ((e, x), Rule((p + "ffn.gate.weight",), BF16_LINEAR))
  if hashed:
    rules[routed + ("tid2eid",)] = ((cfg.vocab_size, cfg.num_experts_per_tok), Rule((p + "ffn.gate.tid2eid",), TABLE))
  elif cfg.routed_bias:
    rules[routed + ("gate", "bias")] = ((x,), Rule((p + "ffn.gate.bias",), F32))
  for mt, hf in (("wi_0", "w1"), ("wi_1", "w3"), ("wo", "w2")):
    rules[routed + (mt,)] = ((x, e, f) if mt != "wo" else (x, f, e),
                             Rule((p + "ffn.experts.{j}." + f"{hf}.weight",), EXPERTS_FP8))
    if width:
      rules[("mlp", "shared_experts", mt, "kernel")] = ((e, width) if mt != "wo" else (width, e),
                                                        Rule((p + f"ffn.shared_experts.{hf}.weight",), FP8))
  return rules


def _key(module_path: tuple[str, ...], cfg) -> tuple[str, ...]:
  if module_path[-1] == "tid2eid":  # Tid2EidVar, not a Param
    return tree.aux_key(module_path)
  return hf_names._stack_key(module_path, cfg)  # pylint: disable=protected-access


def _spell_rule(rule: Rule, spelling: str) -> Rule:
  return Rule(tuple(_spelled(n, spelling) for n in rule.names), rule.kind, rule.n_in, rule.rope, rule.part)


def leaf_plan(cfg, spelling: str = "release") -> dict[tuple[str, ...], Entry]:
  """Every MaxText leaf of `cfg`'s deepseek4 model, keyed as `params.param_leaves` keys it, with its rule."""
  e, v, k, layers = cfg.emb_dim, cfg.vocab_size, cfg.mhc_expansion_rate, cfg.num_decoder_layers
  hashed = cfg.first_num_hash_layers
  top = {
      ("token_embedder", "embedding"): ((v, e), Rule(("embed.weight",), BF16)),
      ("decoder", "decoder_norm", "scale"): ((e,), Rule(("norm.weight",), BF16)),
      ("decoder", "logits_dense", "kernel"): ((e, v), Rule(("head.weight",), BF16_LINEAR)),
      ("decoder", "hc_head", "hc_fn"): ((k * e, k), Rule(("hc_head_fn",), F32_LINEAR)),
      ("decoder", "hc_head", "hc_base"): ((k,), Rule(("hc_head_base",), F32)),
      ("decoder", "hc_head", "hc_scale"): ((1,), Rule(("hc_head_scale",), F32)),
  }
  if cfg.logits_via_embedding:  # tied: the head is the embedding (transformers' tie_word_embeddings)
    del top[("decoder", "logits_dense", "kernel")]
  plan = {tree.param_key(path): Entry(shape, _spell_rule(rule, spelling)) for path, (shape, rule) in top.items()}

  def add(prefix: tuple[str, ...], ratio: int, is_hash: bool, hf_layers: list[int], stacked: bool) -> None:
    for sub, (shape, rule) in layer_rules(cfg, ratio, is_hash).items():
      key = _key(prefix + sub, cfg)
      rule = _spell_rule(rule, spelling)
      if not stacked:
        plan[key] = Entry(shape, rule, tuple(hf_layers))
        continue
      axis = 0 if key[:2] == tree.AUX_PREFIX else min(cfg.param_scan_axis, len(shape))
      plan[key] = Entry(shape[:axis] + (len(hf_layers),) + shape[axis:], rule, tuple(hf_layers), axis)

  unrolled = hashed if cfg.scan_layers else layers
  for i in range(unrolled):
    add(("decoder", f"layers_{i}"), layer_type(cfg, i), i < hashed, [i], False)
  blocks = (layers - hashed) // 2 if cfg.scan_layers else 0
  for j, ratio in enumerate(SCANNED if blocks else ()):
    add(("decoder", "scanned_blocks", f"layers_{j}"), ratio, False, [hashed + 2 * b + j for b in range(blocks)], True)
  return plan


def plan(cfg, table: Iterable[str] | None = None, mtp_shared_copies: bool = True) -> dict[tuple[str, ...], Entry]:
  """The leaf plan of any DeepSeek model: V4's (in the spelling of `table`'s names; the release's without one), or
  DeepSeek-V2/V3's (`hf_names.leaf_plan`)."""
  if cfg.decoder_block != "deepseek4":
    return hf_names.leaf_plan(cfg, mtp_shared_copies)
  return leaf_plan(cfg, spelling_of(table) if table is not None else "release")


def mtp_tensors(table: Iterable[str]) -> list[str]:
  """DeepSeek-V4's MTP block tensors (`mtp.{k}.*`), which MaxText's deepseek4 decoder cannot hold."""
  return sorted(name for name in table if name.startswith(MTP_PREFIXES))


# ---------------------------------------------------------------------------------------------------------
# Conversions of the kinds this module adds (the others are `hf_names`').

def hf_shape(rule: Rule, shape: tuple[int, ...], cfg) -> tuple[int, ...] | None:
  """The HF tensor shape of one layer's slice of a V4-only kind (None for `ONES`: nothing stored)."""
  k = cfg.mhc_expansion_rate
  if rule.kind == F32_LINEAR:
    return (shape[1], shape[0])
  if rule.kind == GROUPED_FP8:
    g, i, o = shape
    return (g * o, i)
  if rule.kind == MHC_FN:
    return ((2 + k) * k, shape[0])
  if rule.kind == MHC_BASE:
    return ((2 + k) * k,)
  if rule.kind == MHC_SCALE:
    return (3,)
  if rule.kind == TABLE:
    return shape
  return None


def _mhc_rows(part: int, k: int) -> slice:
  return (slice(0, k), slice(k, 2 * k), slice(2 * k, 2 * k + k * k))[part]


def to_maxtext(rule: Rule, value: np.ndarray | None, shape: tuple[int, ...], cfg) -> np.ndarray:
  """One layer's MaxText slice (float32) of a V4-only kind from its HF tensor (`value`, float32)."""
  k = cfg.mhc_expansion_rate
  if rule.kind == ONES:
    return np.ones(shape, np.float32)
  if rule.kind == F32_LINEAR:
    return np.ascontiguousarray(value.T)
  if rule.kind == GROUPED_FP8:
    g, i, o = shape
    return np.ascontiguousarray(value.reshape(g, o, i).transpose(0, 2, 1))
  if rule.kind == MHC_FN:
    return np.ascontiguousarray(value[_mhc_rows(rule.part, k)].T)
  if rule.kind == MHC_BASE:
    return value[_mhc_rows(rule.part, k)].reshape(shape)
  if rule.kind == MHC_SCALE:
    return value[rule.part:rule.part + 1]
  return value.reshape(shape)  # TABLE


def grouped_matrix(kernel) -> np.ndarray:
  """o_a_proj's kernel (G, I, O) as the release's (G·O, I) weight (float32)."""
  kernel = np.asarray(kernel, np.float32)
  g, i, o = kernel.shape
  return np.ascontiguousarray(kernel.transpose(0, 2, 1).reshape(g * o, i))


def mhc_tensor(parts: list[Any], kind: str) -> np.ndarray:
  """The release's mHC tensor of one layer from MaxText's three parts (pre, post, res), float32."""
  parts = [np.asarray(p, np.float32) for p in parts]
  if kind == MHC_FN:
    return np.ascontiguousarray(np.concatenate([p.T for p in parts], axis=0))
  return np.concatenate([p.reshape(-1) for p in parts])


def linear_matrix(kernel, rule: Rule, cfg) -> np.ndarray:
  """A Linear kernel of any V4 matrix kind as its float32 (in, out) matrix (the transpose of the HF weight)."""
  if rule.kind == GROUPED_FP8:
    return np.ascontiguousarray(grouped_matrix(kernel).T)
  return hf_names.kernel_matrix(kernel, rule, cfg)

