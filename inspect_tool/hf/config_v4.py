"""The MaxText keys of a DeepSeek-V4 `config.json` (`model_type: deepseek_v4`), in DeepSeek's release spelling
(`compress_ratios`, `num_hash_layers`, `rope_scaling`, `compress_rope_theta`) or transformers 5.24's
(`layer_types` with `compress_rates`, `mlp_layer_types`, `rope_parameters: {main, compress}`); fields left out
take transformers' `DeepseekV4Config` defaults. MaxText 0.2.5's `deepseek4-284b` preset with every key that changes
shapes or the computation set, as MaxText's own V4 configuration (`hf_model_configs.py`) relates them.

Refused in one line (MaxText computes them differently and no key changes that): a CSA compress rate other than 4
(MaxText makes ratio 4 the CSA layer), hash-routed layers that are not the first ones, more than one key/value
head, `hc_eps` or `rms_norm_eps` other than MaxText's fixed 1e-6 (its mHC and `hc_head`), a `swiglu_limit` <= 0,
softmax scores (transformers' V4 router always renormalizes the top-k weights; MaxText does so for sigmoid and
sqrtsoftplus), a non-SiLU activation, biases. Layers that MaxText's scanned tree cannot hold (after the hash layers,
pairs of HCA 128 then CSA 4) give `scan_layers=false`.

Not expressible, imported anyway and named (`differences`): YaRN (`rope_scaling` of the compressed layers, as
DeepSeek-V4-Flash ships it): MaxText's deepseek4 runs plain RoPE (`rope_type: default`) on every layer, as its own
284B config does for that very release.
"""

from __future__ import annotations

import math
from typing import Any, Callable

from inspect_tool.hf import names_v4 as hf_names_v4

TYPES = {"head_dim": "int", "o_groups": "int", "o_lora_rank": "int", "sliding_window": "int", "hc_mult": "int",
         "hc_sinkhorn_iters": "int", "hc_eps": "float", "swiglu_limit": "float", "compress_rope_theta": "float",
         "num_hash_layers": "int0", "compress_ratios": "list", "layer_types": "list", "mlp_layer_types": "list",
         "compress_rates": "dict?", "partial_rotary_factor": "float?", "mlp_bias": "bool"}
# transformers 5.24's DeepseekV4Config defaults of fields a config.json may leave out.
DEFAULTS = {"n_shared_experts": 1, "scoring_func": "sqrtsoftplus", "routed_scaling_factor": 1.5, "rope_theta": 10000.0,
            "compress_rope_theta": 160000.0, "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
            "swiglu_limit": 10.0, "sliding_window": 128, "index_n_heads": 64, "index_head_dim": 128,
            "index_topk": 512, "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "num_key_value_heads": 1,
            "max_position_embeddings": 1048576, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
            "num_hash_layers": 3, "q_lora_rank": 1024, "o_groups": 8, "o_lora_rank": 1024, "head_dim": 512}
REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "moe_intermediate_size",
            "n_routed_experts", "num_experts_per_tok")
MODEL_NAME = "deepseek4-284b"
FIXED_EPS = 1e-6  # MaxText's mHC, Sinkhorn and hc_head epsilon
_TYPE_RATIO = {"sliding_attention": 0, "compressed_sparse_attention": "csa", "heavily_compressed_attention": "hca"}
_DEFAULT_RATES = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}


def _ratios(doc: dict, layers: int, bad: Callable[[str], Exception]) -> list[int]:
  """Every layer's compress ratio, from `layer_types` + `compress_rates`, `compress_ratios` (the release's, one
  more entry for its MTP layer) or transformers' default schedule."""
  if doc.get("layer_types") is not None:
    rates = dict(_DEFAULT_RATES) | (doc.get("compress_rates") or {})
    ratios = []
    for kind in doc["layer_types"][:layers]:
      if kind not in _TYPE_RATIO:
        raise bad(f"layer_types entry {str(kind)[:40]!r} is not a DeepSeek-V4 layer type; accepted: "
                  + ", ".join(_TYPE_RATIO))
      ratio = _TYPE_RATIO[kind]
      ratios.append(0 if ratio == 0 else rates[kind])
  elif doc.get("compress_ratios") is not None:
    ratios = list(doc["compress_ratios"][:layers])
  else:  # transformers' default: two HCA layers, then CSA and HCA alternately
    ratios = [128] * min(layers, 2) + [4 if i % 2 else 128 for i in range(max(layers - 2, 0))]
  if len(ratios) < layers or not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in ratios):
    raise bad(f"compress ratios {str(ratios)[:80]} are not {layers} non-negative integers, one per layer")
  types = doc.get("layer_types") or []
  for i, ratio in enumerate(ratios):
    csa = types[i] == "compressed_sparse_attention" if types else ratio == 4
    if csa and ratio != 4:
      raise bad(f"compressed sparse attention at ratio {ratio} (layer {i}) cannot be expressed in MaxText, whose "
                "CSA layers have ratio 4; accepted: compress rate 4 for CSA")
    if not csa and 0 < ratio <= 4:
      raise bad(f"heavily compressed attention at ratio {ratio} (layer {i}) cannot be expressed in MaxText (ratio "
                "4 is its CSA layer); accepted: HCA ratios above 4")
  return ratios


def _hash_layers(doc: dict, layers: int, get, bad) -> int:
  types = doc.get("mlp_layer_types")
  if types is None:
    return min(layers, get("num_hash_layers"))
  hashed = sum(1 for t in types[:layers] if t == "hash_moe")
  if list(types[:layers]) != ["hash_moe"] * hashed + ["moe"] * (layers - hashed):
    raise bad(f"mlp_layer_types {str(types)[:80]} cannot be expressed in MaxText: its hash-routed layers are the "
              "first ones (first_num_hash_layers); accepted: hash_moe layers, then moe layers")
  return hashed


def _rope(doc: dict, get, bad, integral) -> tuple[dict[str, Any], list[str]]:
  """(keys, differences): the two RoPE thetas; YaRN or another RoPE type is a difference MaxText does not run."""
  params = doc.get("rope_parameters") or {}
  nested = isinstance(params.get("main"), dict) and isinstance(params.get("compress"), dict)
  main = params["main"] if nested else {"rope_type": "default", "rope_theta": get("rope_theta")}
  compress = params["compress"] if nested else dict(doc.get("rope_scaling") or {},
                                                    rope_theta=get("compress_rope_theta"))
  differences = []
  for label, found in (("main", main), ("compress", compress)):
    kind = found.get("rope_type", found.get("type", "default"))
    if kind != "default":
      factor = found.get("factor")
      differences.append(f"{'rope_parameters.' + label if nested else 'rope_scaling'}: {kind} (factor {factor}) on "
                         f"the {'sliding-window' if label == 'main' else 'compressed'} layers; MaxText's deepseek4 "
                         "runs plain RoPE there (rope_type default), as its own 284B config does")
  keys = {"rope_max_timescale": integral("rope_theta", main.get("rope_theta", get("rope_theta"))),
          "compressed_rope_max_timescale": integral("compress_rope_theta",
                                                    compress.get("rope_theta", get("compress_rope_theta")))}
  factor = (main.get("partial_rotary_factor") if nested else None) or doc.get("partial_rotary_factor")
  rope_dims = doc.get("qk_rope_head_dim")
  if rope_dims is None:
    rope_dims = int(get("head_dim") * (factor if factor is not None else 64 / 512))
  if not isinstance(rope_dims, int) or not 0 < rope_dims <= get("head_dim") or rope_dims % 2:
    raise bad(f"qk_rope_head_dim {rope_dims} is not an even number of dims within head_dim={get('head_dim')}")
  return keys | {"qk_rope_head_dim": rope_dims}, differences


def derive(doc: dict, layers_stored: dict[str, Any], bad: Callable[[str], Exception],
           integral: Callable[[str, float], int]) -> tuple[dict[str, Any], list[str]]:
  """(MaxText keys, differences MaxText does not compute) of a V4 config.json `doc`.

  `layers_stored`: {"gate_bias": any `ffn.gate.bias` stored}; `bad(text)` makes the one-line error;
  `integral(name, value)` checks a theta is an integer.
  """
  missing = [name for name in REQUIRED if doc.get(name) is None]
  if missing:
    raise bad(f"{missing[0]} is missing; a DeepSeek-V4 config.json needs {', '.join(REQUIRED)}")

  def get(name: str):
    return doc[name] if doc.get(name) is not None else DEFAULTS.get(name)

  for name, want in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False),
                     ("num_key_value_heads", 1)):
    if get(name) != want:
      raise bad(f"{name}={str(get(name)).lower()} cannot be expressed in MaxText's deepseek4 decoder; accepted: "
                f"{str(want).lower()}")
  for name in ("hc_eps", "rms_norm_eps"):
    if not math.isclose(float(get(name)), FIXED_EPS, rel_tol=1e-9):
      raise bad(f"{name}={get(name)!r} cannot be expressed in MaxText, whose mHC and hc_head use a fixed {FIXED_EPS}")
  score = get("scoring_func")
  if score not in ("sqrtsoftplus", "sigmoid"):
    raise bad(f"scoring_func={str(score)[:40]!r} cannot be expressed in MaxText with transformers' V4 routing "
              "(top-k weights always renormalized); accepted: sqrtsoftplus, sigmoid")
  if float(get("swiglu_limit")) <= 0:
    raise bad(f"swiglu_limit={get('swiglu_limit')} clamps every activation to at most 0 in transformers; MaxText "
              "does not clip at limits <= 0; accepted: a positive limit")
  layers = doc["num_hidden_layers"]
  ratios = _ratios(doc, layers, bad)
  hashed = _hash_layers(doc, layers, get, bad)
  rope, differences = _rope(doc, get, bad, integral)
  moe = doc["moe_intermediate_size"]
  keys: dict[str, Any] = {
      "model_name": MODEL_NAME, "override_model_config": True, "base_emb_dim": doc["hidden_size"],
      "base_num_query_heads": doc["num_attention_heads"], "base_num_kv_heads": 1, "base_mlp_dim": moe,
      "base_moe_mlp_dim": moe, "base_num_decoder_layers": layers, "vocab_size": doc["vocab_size"],
      "head_dim": get("head_dim"), "q_lora_rank": get("q_lora_rank"), "o_groups": get("o_groups"),
      "o_lora_rank": get("o_lora_rank"), "sliding_window_size": get("sliding_window"), "compress_ratios": ratios,
      "first_num_hash_layers": hashed, "mhc_expansion_rate": get("hc_mult"),
      "sinkhorn_iterations": get("hc_sinkhorn_iters"), "num_experts": doc["n_routed_experts"],
      "num_experts_per_tok": doc["num_experts_per_tok"], "shared_experts": get("n_shared_experts"),
      "routed_scaling_factor": float(get("routed_scaling_factor")), "routed_score_func": score,
      "routed_bias": bool(layers_stored.get("gate_bias")), "mlp_activations_limit": float(get("swiglu_limit")),
      "use_indexer": True, "indexer_n_heads": get("index_n_heads"), "indexer_head_dim": get("index_head_dim"),
      "indexer_topk": get("index_topk"), "normalization_layer_epsilon": float(get("rms_norm_eps")),
      "logits_via_embedding": bool(get("tie_word_embeddings")),
      "max_position_embeddings": get("max_position_embeddings")} | rope | {"mtp_num_layers": 0}
  if not hf_names_v4.scannable(ratios, hashed):
    keys["scan_layers"] = False
  return keys, differences


# Model attribute -> MaxText key, compared between a model and a V4 directory's keys.
COMPARED = (
    ("decoder_block", "decoder_block"), ("attention_type", "attention_type"),
    ("mhc_expansion_rate", "mhc_expansion_rate"), ("emb_dim", "base_emb_dim"),
    ("num_query_heads", "base_num_query_heads"), ("num_kv_heads", "base_num_kv_heads"),
    ("moe_mlp_dim", "base_moe_mlp_dim"), ("num_decoder_layers", "base_num_decoder_layers"),
    ("vocab_size", "vocab_size"), ("head_dim", "head_dim"), ("qk_rope_head_dim", "qk_rope_head_dim"),
    ("q_lora_rank", "q_lora_rank"), ("o_groups", "o_groups"), ("o_lora_rank", "o_lora_rank"),
    ("sliding_window_size", "sliding_window_size"), ("first_num_hash_layers", "first_num_hash_layers"),
    ("sinkhorn_iterations", "sinkhorn_iterations"), ("num_experts", "num_experts"),
    ("num_experts_per_tok", "num_experts_per_tok"), ("shared_experts", "shared_experts"),
    ("routed_scaling_factor", "routed_scaling_factor"), ("routed_score_func", "routed_score_func"),
    ("routed_bias", "routed_bias"), ("mlp_activations_limit", "mlp_activations_limit"),
    ("use_indexer", "use_indexer"), ("indexer_n_heads", "indexer_n_heads"),
    ("indexer_head_dim", "indexer_head_dim"), ("indexer_topk", "indexer_topk"),
    ("normalization_layer_epsilon", "normalization_layer_epsilon"), ("logits_via_embedding", "logits_via_embedding"),
    ("rope_type", "rope_type"), ("rope_max_timescale", "rope_max_timescale"),
    ("compressed_rope_max_timescale", "compressed_rope_max_timescale"), ("mtp_num_layers", "mtp_num_layers"),
)


def layout_conflicts(cfg, keys: dict[str, Any]) -> list[tuple[str, str]]:
  """The ways a deepseek4 model's layer schedule differs from the directory's: compress ratios per layer, and a
  scanned tree (fixed HCA 128 / CSA 4 pairs) for a schedule it cannot hold."""
  found = []
  ours = [int(r) for r in cfg.compress_ratios[:cfg.num_decoder_layers]]
  theirs = list(keys["compress_ratios"])
  if cfg.scan_layers:
    ours = ours[:cfg.first_num_hash_layers] + list(hf_names_v4.SCANNED) * ((cfg.num_decoder_layers
                                                                             - cfg.first_num_hash_layers) // 2)
  if ours != theirs:
    shown = "[" + ",".join(map(str, theirs)) + "]"
    scanned = " (scan_layers=true runs HCA 128 / CSA 4 pairs after the hash layers)" if cfg.scan_layers else ""
    found.append(("compress_ratios", f"compress ratios: the model runs {ours}{scanned}, config.json gives "
                  f"compress_ratios={shown}" + ("; add scan_layers=false" if keys.get("scan_layers") is False
                                                and cfg.scan_layers else "")))
  return found
