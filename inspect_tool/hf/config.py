"""The MaxText keys of a Hugging Face DeepSeek directory: its `config.json` and the tensors it stores.

`derive_keys(path)` reads `config.json` (every field it uses typed; a wrong JSON type is one line naming the field)
and the safetensors headers, and returns every MaxText key that changes shapes or the computation, in order:
sizes, MLA ranks and head dims, routing (`num_experts_per_tok`, `routed_scaling_factor`, score function, gate bias
when `e_score_correction_bias` is stored, routing groups), norm epsilon, tied embeddings, RoPE (YaRN factor,
mscale, interleave, truncation, attention scaling), the MTP layers actually stored (`model.layers.{L+k-1}.eh_proj`,
not `num_nextn_predict_layers`) and V3.2's indexer. The RoPE parameters are read from transformers 5's
`rope_parameters`, transformers 4's `rope_scaling` (DeepSeek's published spelling) and a top-level `rope_theta`.

How Hugging Face reads them (transformers' DeepseekV3/V2 code), and what MaxText runs for each key:
* YaRN: frequencies from factor, original_max_position_embeddings, beta_fast/slow, truncate, rope_theta (MaxText:
  the same keys). transformers takes the factor as max_position_embeddings / original_max_position_embeddings
  when the latter is given, so a different `factor` is refused (readers disagree).
* q/k gain: `attention_factor`, else mscale(f, mscale) / mscale(f, mscale_all_dim) when both are non-zero, else
  mscale(f) = 0.1 ln f + 1; MaxText: 0.1 ln f + 1 with `rope_attention_scaling`, else 1. Other gains are refused.
* softmax scale: (dn+dr)^-0.5 times mscale(f, mscale_all_dim)^2 when mscale_all_dim is non-zero; MaxText: the
  same times (0.1 mscale ln f + 1)^2 when max_position_embeddings > original_max_position_embeddings, so
  `mscale` = mscale_all_dim (0 when HF applies none).
* no rope_scaling: plain RoPE, which is YaRN with factor 1 (MaxText's MLA runs YaRN only).
* routing: DeepSeek-V3 (sigmoid, `noaux_tc`, renormalized: MaxText always renormalizes sigmoid weights);
  DeepSeek-V2 (softmax, `greedy`, not renormalized). Anything else is refused.
"""

from __future__ import annotations

import math
import os
import re
from typing import Any

from inspect_tool import errors
from inspect_tool.checkpoint import files
from inspect_tool.hf import config_v4 as hf_config_v4
from inspect_tool.hf import tensors as hf_tensors
from inspect_tool.hf import safetensors_header
from inspect_tool.configuration import config as config_lib

CONFIG_NAME = hf_tensors.CONFIG_NAME
_MAX_BYTES = 1 << 20

# Field -> expected JSON type: "int" (positive), "int0" (non-negative), "int?" (positive or null), "float",
# "bool", "str", "dict?", "list".
_TYPES = {
    "hidden_size": "int", "num_hidden_layers": "int", "num_attention_heads": "int", "num_key_value_heads": "int",
    "vocab_size": "int", "intermediate_size": "int", "moe_intermediate_size": "int", "n_routed_experts": "int",
    "num_experts_per_tok": "int", "n_shared_experts": "int0", "first_k_dense_replace": "int0",
    "moe_layer_freq": "int", "n_group": "int?", "topk_group": "int?", "q_lora_rank": "int?", "kv_lora_rank": "int",
    "qk_nope_head_dim": "int", "qk_rope_head_dim": "int", "v_head_dim": "int", "num_nextn_predict_layers": "int0",
    "max_position_embeddings": "int", "routed_scaling_factor": "float", "rms_norm_eps": "float",
    "rope_theta": "float", "norm_topk_prob": "bool", "tie_word_embeddings": "bool", "rope_interleave": "bool",
    "attention_bias": "bool", "scoring_func": "str", "topk_method": "str", "hidden_act": "str",
    "model_type": "str", "architectures": "list", "rope_scaling": "dict?", "rope_parameters": "dict?",
    "quantization_config": "dict?",
    "index_n_heads": "int", "index_head_dim": "int", "index_topk": "int",
} | hf_config_v4.TYPES
_ROPE_TYPES = {"type": "str", "rope_type": "str", "factor": "float", "original_max_position_embeddings": "int",
               "beta_fast": "float", "beta_slow": "float", "mscale": "float", "mscale_all_dim": "float",
               "attention_factor": "float?", "truncate": "bool", "rope_theta": "float"}
_EXPECTED = {"int": "a positive integer", "int0": "a non-negative integer", "int?": "a positive integer or null",
             "float": "a number", "float?": "a number or null", "bool": "true or false", "str": "a string",
             "dict?": "an object or null", "list": "a list"}
_REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "intermediate_size",
             "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok", "kv_lora_rank",
             "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
# transformers' defaults of the fields a config.json may leave out (DeepseekV3Config / DeepseekV2Config).
_DEFAULTS = {
    "v3": {"n_shared_experts": 1, "first_k_dense_replace": 3, "moe_layer_freq": 1, "n_group": 8, "topk_group": 4,
           "routed_scaling_factor": 2.5, "norm_topk_prob": True, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
           "q_lora_rank": 1536, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
           "rope_interleave": True, "attention_bias": False, "hidden_act": "silu", "max_position_embeddings": 4096,
           "num_nextn_predict_layers": 0},
    "v2": {"n_shared_experts": 0, "first_k_dense_replace": 0, "moe_layer_freq": 1, "n_group": None,
           "topk_group": None, "routed_scaling_factor": 1.0, "norm_topk_prob": False, "scoring_func": "softmax",
           "topk_method": "greedy", "q_lora_rank": 1536, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
           "tie_word_embeddings": False, "rope_interleave": True, "attention_bias": False, "hidden_act": "silu",
           "max_position_embeddings": 2048, "num_nextn_predict_layers": 0},
}
# model_type -> (routing family, MaxText model_name that builds it).
_FAMILIES = {"deepseek_v3": ("v3", "deepseek3-671b"), "kimi_k2": ("v3", "deepseek3-671b"),
             "deepseek_v32": ("v3", "deepseek3.2-671b"), "deepseek_v2": ("v2", "deepseek2-16b"),
             "deepseek_v4": ("v4", hf_config_v4.MODEL_NAME)}
_ARCHITECTURES = {"DeepseekV3ForCausalLM": "deepseek_v3", "DeepseekV32ForCausalLM": "deepseek_v32",
                  "DeepseekV2ForCausalLM": "deepseek_v2", "DeepseekV4ForCausalLM": "deepseek_v4"}
_MTP_TENSOR = re.compile(r"^model\.layers\.(\d+)\.eh_proj\.weight$")


def _bad(path: str, text: str) -> errors.CheckpointError:
  return errors.CheckpointError(f"{os.path.join(path, CONFIG_NAME)}: {text}")


def _check_type(path: str, name: str, value: Any, kind: str) -> None:
  nullable = kind.endswith("?")
  base = kind.rstrip("?")
  if value is None and nullable:
    return
  ok = {"int": lambda v: isinstance(v, int) and not isinstance(v, bool) and v > 0,
        "int0": lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0,
        "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v),
        "bool": lambda v: isinstance(v, bool), "str": lambda v: isinstance(v, str),
        "dict": lambda v: isinstance(v, dict), "list": lambda v: isinstance(v, list)}[base]
  if not ok(value):
    shown = repr(value) if not isinstance(value, (dict, list)) else type(value).__name__
    raise _bad(path, f"{name} is {shown[:40]}; expected {_EXPECTED[kind]}")


def read_config(path: str) -> dict[str, Any]:
  """`config.json` of the directory `path`, every field this module reads checked for its JSON type."""
  config_path = os.path.join(path, CONFIG_NAME)
  if files.kind(config_path) != "file":
    raise _bad(path, "is missing or not a regular file")
  doc = files.parse_json(files.read_bytes(config_path, _MAX_BYTES, "Hugging Face config"),
                         lambda why: _bad(path, why))
  if not isinstance(doc, dict):
    raise _bad(path, f"holds a {type(doc).__name__}; expected a JSON object")
  for name, kind in _TYPES.items():
    if name in doc:
      _check_type(path, name, doc[name], kind)
  for holder in ("rope_scaling", "rope_parameters"):
    for name, kind in _ROPE_TYPES.items():
      if isinstance(doc.get(holder), dict) and name in doc[holder]:
        _check_type(path, f"{holder}.{name}", doc[holder][name], kind)
  return doc


def stored_rope_interleaved(path: str) -> bool:
  """Whether the rope columns of q_b_proj / kv_a_proj_with_mqa are stored interleaved (`rope_interleave`)."""
  if files.kind(os.path.join(path, CONFIG_NAME)) != "file":
    return True
  return read_config(path).get("rope_interleave", True)


def _family(path: str, doc: dict) -> tuple[str, str, str]:
  model_type = doc.get("model_type")
  if model_type is None:
    archs = doc.get("architectures") or []
    model_type = next((_ARCHITECTURES[a] for a in archs if a in _ARCHITECTURES), None)
  if model_type not in _FAMILIES:
    raise _bad(path, f"model_type {errors.shown(model_type)} is not a DeepSeek model MaxText builds; accepted: "
               + ", ".join(sorted(_FAMILIES)))
  family, model_name = _FAMILIES[model_type]
  return model_type, family, model_name


def _rope(path: str, doc: dict, get) -> dict[str, Any]:
  """The RoPE keys: YaRN from rope_parameters / rope_scaling, or plain RoPE as YaRN with factor 1."""
  params = doc.get("rope_parameters") or doc.get("rope_scaling") or {}
  theta = params.get("rope_theta", doc.get("rope_theta", get("rope_theta")))
  rope_type = params.get("rope_type", params.get("type", "default"))
  max_pos = get("max_position_embeddings")
  keys: dict[str, Any] = {"rope_type": "yarn", "rope_max_timescale": _integral(path, "rope_theta", theta),
                          "max_position_embeddings": max_pos}
  if rope_type == "default":
    return keys | {"original_max_position_embeddings": max_pos, "rope_factor": 1.0, "beta_fast": 32.0,
                   "beta_slow": 1.0, "mscale": 0.0, "rope_truncate": True, "rope_attention_scaling": False}
  if rope_type != "yarn":
    raise _bad(path, f"rope type {errors.shown(rope_type)} cannot be expressed in MaxText's MLA; accepted: yarn, or no "
               "rope_scaling (plain RoPE)")
  original = params.get("original_max_position_embeddings", max_pos)
  # As transformers 5 (and DeepSeek's and vLLM's code) read it: the factor written wins; without one, the ratio of
  # the context lengths (transformers 4 took the ratio whenever the original length was given).
  factor = float(params["factor"]) if params.get("factor") is not None else max_pos / original

  def m(scale: float, ms: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * ms * math.log(scale) + 1.0

  mscale, mscale_all_dim = float(params.get("mscale") or 0), float(params.get("mscale_all_dim") or 0)
  gain = params.get("attention_factor")
  if gain is None:
    gain = m(factor, mscale) / m(factor, mscale_all_dim) if mscale and mscale_all_dim else m(factor)
  if math.isclose(gain, 1.0, rel_tol=1e-9):
    scaling = False
  elif factor > 1 and math.isclose(gain, m(factor), rel_tol=1e-9):
    scaling = True
  else:
    raise _bad(path, f"rope attention factor {gain:g} cannot be expressed in MaxText (1, or 0.1 ln(factor) + 1 "
               "with rope_attention_scaling=true)")
  softmax_mscale = mscale_all_dim if factor > 1 else 0.0
  if softmax_mscale and max_pos <= original:
    raise _bad(path, f"mscale_all_dim={mscale_all_dim:g} scales the softmax, which MaxText does only when "
               f"max_position_embeddings ({max_pos}) > original_max_position_embeddings ({original})")
  return keys | {"original_max_position_embeddings": original, "rope_factor": factor,
                 "beta_fast": float(params.get("beta_fast") or 32), "beta_slow": float(params.get("beta_slow") or 1),
                 "mscale": softmax_mscale, "rope_truncate": params.get("truncate", True),
                 "rope_attention_scaling": scaling}


def _integral(path: str, name: str, value: float) -> int:
  if float(value) != int(value):
    raise _bad(path, f"{name} {value} is not an integer, which MaxText's rope_max_timescale needs")
  return int(value)


def stored_mtp_layers(table, num_layers: int) -> int:
  """MTP layers stored as DeepSeek's release stores them: `model.layers.{L..L+k-1}.eh_proj.weight`."""
  found = {int(m[1]) for m in map(_MTP_TENSOR.match, table) if m}
  depth = 0
  while num_layers + depth in found:
    depth += 1
  return depth


_BIAS_SUFFIXES = (".mlp.gate.e_score_correction_bias", ".ffn.gate.bias")  # DeepSeek-V3's, V4's


def _nonzero_bias(path: str) -> bool:
  """Whether any stored gate bias is non-zero (the only tensor data this module reads)."""
  tensors = hf_tensors.Tensors(path)
  names = [name for name in tensors.table if name.endswith(_BIAS_SUFFIXES)]
  return any(bool(tensors.read(name).any()) for name in names)


def _routing(path: str, family: str, get, table, first_moe: int) -> dict[str, Any]:
  score, method, renorm = get("scoring_func"), get("topk_method"), get("norm_topk_prob")
  x, groups, top_groups = get("n_routed_experts"), get("n_group"), get("topk_group")
  grouped = bool(groups and groups > 1 and top_groups and top_groups < groups)
  if family == "v3":
    if score != "sigmoid" or method != "noaux_tc" or not renorm:
      raise _bad(path, f"DeepSeek-V3 routing with scoring_func={errors.shown(score)}, "
                 f"topk_method={errors.shown(method)}, "
                 f"norm_topk_prob={str(renorm).lower()} cannot be expressed in MaxText; accepted: sigmoid, "
                 "noaux_tc, true")
    bias = any(name.endswith(".mlp.gate.e_score_correction_bias") for name in table)
  else:
    if score != "softmax" or renorm or (method == "group_limited_greedy" and grouped) or method not in (
        "greedy", "group_limited_greedy"):
      raise _bad(path, f"DeepSeek-V2 routing with scoring_func={errors.shown(score)}, "
                 f"topk_method={errors.shown(method)}, "
                 f"norm_topk_prob={str(renorm).lower()}, topk_group/n_group={top_groups}/{groups} cannot be "
                 "expressed in MaxText; accepted: softmax, greedy, false")
    bias, grouped = False, False
  if grouped and x % groups:
    raise _bad(path, f"n_routed_experts={x} is not a multiple of n_group={groups}")
  return {"num_experts": x, "num_experts_per_tok": get("num_experts_per_tok"), "shared_experts":
          get("n_shared_experts") or 0, "routed_scaling_factor": float(get("routed_scaling_factor")),
          "routed_score_func": score, "routed_bias": bias,
          "n_routing_groups": groups if grouped else -1, "topk_routing_group": top_groups if grouped else -1}


def derive_keys(path: str) -> dict[str, Any]:
  """Every MaxText key (name -> typed value) that the HF DeepSeek directory `path` determines, in order.

  Raises:
    errors.CheckpointError: config.json unreadable, a field of the wrong JSON type, or a setting MaxText cannot
      express (one line naming it).
  """
  return _derive(path)[0]


def differences(path: str) -> list[str]:
  """What the directory's model computes that MaxText, with the derived keys, does not (DeepSeek-V4's YaRN)."""
  return _derive(path)[1]


def _derive(path: str) -> tuple[dict[str, Any], list[str]]:
  doc = read_config(path)
  model_type, family, model_name = _family(path, doc)
  if family == "v4":
    table = safetensors_header.read_tensor_table(path)
    stored = {"gate_bias": any(name.endswith(".ffn.gate.bias") for name in table)}
    return hf_config_v4.derive(doc, stored, lambda text: _bad(path, text),
                               lambda name, value: _integral(path, name, value))
  missing = [name for name in _REQUIRED if doc.get(name) is None]
  if missing:
    raise _bad(path, f"{missing[0]} is missing; a DeepSeek config.json needs {', '.join(_REQUIRED)}")
  defaults = _DEFAULTS[family]

  def get(name: str):
    return doc[name] if name in doc else defaults.get(name)

  for name, want in (("hidden_act", "silu"), ("attention_bias", False), ("moe_layer_freq", 1)):
    if get(name) != want:
      raise _bad(path, f"{name}={errors.shown(get(name))} cannot be expressed in MaxText's DeepSeek decoder; accepted: "
                 f"{str(want).lower() if isinstance(want, bool) else want}")
  heads = doc["num_attention_heads"]
  if get("num_key_value_heads") not in (None, heads):
    raise _bad(path, f"num_key_value_heads={doc['num_key_value_heads']} differs from num_attention_heads={heads}: "
               "MLA has one key per query head")
  layers, dense = doc["num_hidden_layers"], get("first_k_dense_replace")
  if dense > layers:
    raise _bad(path, f"first_k_dense_replace={dense} exceeds num_hidden_layers={layers}")
  table = safetensors_header.read_tensor_table(path)
  keys: dict[str, Any] = {
      "model_name": model_name, "override_model_config": True,
      "base_emb_dim": doc["hidden_size"], "base_num_query_heads": heads, "base_num_kv_heads": heads,
      "base_mlp_dim": doc["intermediate_size"], "base_moe_mlp_dim": doc["moe_intermediate_size"],
      "base_num_decoder_layers": layers, "first_num_dense_layers": dense, "vocab_size": doc["vocab_size"]}
  keys |= _routing(path, family, get, table, dense)
  keys |= {"q_lora_rank": get("q_lora_rank") or 0, "kv_lora_rank": doc["kv_lora_rank"],
           "qk_nope_head_dim": doc["qk_nope_head_dim"], "qk_rope_head_dim": doc["qk_rope_head_dim"],
           "v_head_dim": doc["v_head_dim"], "normalization_layer_epsilon": float(get("rms_norm_eps")),
           "logits_via_embedding": get("tie_word_embeddings")}
  keys |= _rope(path, doc, get)
  keys["rope_interleave"] = get("rope_interleave")
  keys["mtp_num_layers"] = stored_mtp_layers(table, layers)
  if model_type == "deepseek_v32":
    for name in ("index_n_heads", "index_head_dim", "index_topk"):
      if doc.get(name) is None:
        raise _bad(path, f"{name} is missing; DeepSeek-V3.2's indexer needs it")
    keys |= {"use_indexer": True, "indexer_n_heads": doc["index_n_heads"], "indexer_head_dim": doc["index_head_dim"],
             "indexer_topk": doc["index_topk"]}
  return keys, []


def format_value(value: Any) -> str:
  """A key's value as a command-line token writes it (true/false, integers without '.0' only when integral)."""
  if isinstance(value, bool):
    return "true" if value else "false"
  if isinstance(value, float):
    return repr(value)
  if isinstance(value, (list, tuple)):
    return "[" + ",".join(format_value(v) for v in value) + "]"
  return str(value)


def tokens(keys: dict[str, Any]) -> list[str]:
  """`key=value` tokens of `derive_keys`' result."""
  return [f"{key}={format_value(value)}" for key, value in keys.items()]


# Model attribute -> the MaxText key that sets it (at global_parameter_scale 1), compared with config.json's.
_COMPARED = (
    ("decoder_block", "decoder_block"), ("attention_type", "attention_type"),
    ("deepseek_routing", "model_name"), ("mhc_expansion_rate", "mhc_expansion_rate"),
    ("emb_dim", "base_emb_dim"), ("num_query_heads", "base_num_query_heads"), ("num_kv_heads", "base_num_kv_heads"),
    ("mlp_dim", "base_mlp_dim"), ("moe_mlp_dim", "base_moe_mlp_dim"), ("num_decoder_layers", "base_num_decoder_layers"),
    ("first_num_dense_layers", "first_num_dense_layers"), ("vocab_size", "vocab_size"),
    ("num_experts", "num_experts"), ("num_experts_per_tok", "num_experts_per_tok"),
    ("shared_experts", "shared_experts"), ("routed_scaling_factor", "routed_scaling_factor"),
    ("routed_score_func", "routed_score_func"), ("routed_bias", "routed_bias"),
    ("q_lora_rank", "q_lora_rank"), ("kv_lora_rank", "kv_lora_rank"), ("qk_nope_head_dim", "qk_nope_head_dim"),
    ("qk_rope_head_dim", "qk_rope_head_dim"), ("v_head_dim", "v_head_dim"),
    ("normalization_layer_epsilon", "normalization_layer_epsilon"), ("logits_via_embedding", "logits_via_embedding"),
    ("rope_type", "rope_type"), ("rope_max_timescale", "rope_max_timescale"), ("rope_factor", "rope_factor"),
    ("rope_interleave", "rope_interleave"), ("mtp_num_layers", "mtp_num_layers"), ("use_indexer", "use_indexer"),
)
_YARN = (("original_max_position_embeddings", "original_max_position_embeddings"), ("beta_fast", "beta_fast"),
         ("beta_slow", "beta_slow"), ("rope_truncate", "rope_truncate"))
_INDEXER = (("indexer_n_heads", "indexer_n_heads"), ("indexer_head_dim", "indexer_head_dim"),
            ("indexer_topk", "indexer_topk"))


def _same(a: Any, b: Any) -> bool:
  if isinstance(a, float) or isinstance(b, float):
    return isinstance(a, (int, float)) and isinstance(b, (int, float)) and math.isclose(a, b, rel_tol=1e-9)
  return a == b


def _groups(cfg) -> tuple[int, int] | None:
  """Routing groups that restrict anything (None: every group kept, or no grouping)."""
  n, k = cfg.n_routing_groups, cfg.topk_routing_group
  return (n, k) if cfg.deepseek_routing and n > 1 and 0 < k < n else None


def _gain(cfg) -> float:
  return 0.1 * math.log(cfg.rope_factor) + 1.0 if cfg.rope_attention_scaling and cfg.rope_factor > 1 else 1.0


def conflicts(cfg, keys: dict[str, Any], path: str) -> list[tuple[str, str]]:
  """(MaxText key, sentence) for every way `cfg` computes differently from the keys `keys` of directory `path`.

  A model without the gate bias computes as the stored bias when it is all zero (the exporter writes zeros for
  such models); one with the bias reads whatever is stored.
  """
  want = config_lib.resolve_config(tokens(keys))
  if want.decoder_block == "deepseek4" or cfg.decoder_block == "deepseek4":
    return _conflicts_v4(cfg, want, keys, path)
  pairs = list(_COMPARED) + (list(_YARN) if want.rope_factor != 1 or cfg.rope_factor != 1 else [])
  pairs += list(_INDEXER) if want.use_indexer else []
  found = []
  for attr, key in pairs:
    ours, theirs = getattr(cfg, attr), getattr(want, attr)
    if _same(ours, theirs) or (attr == "routed_bias" and (ours or not _nonzero_bias(path))):
      continue  # a missing bias shows as a missing tensor
    shown = keys.get(key, theirs)
    found.append((key, f"{attr}: the model has {format_value(ours)}, config.json gives {key}={format_value(shown)}"))
  if _groups(cfg) != _groups(want):
    found.append(("n_routing_groups", f"routing groups (n_routing_groups, topk_routing_group): the model has "
                  f"{_groups(cfg) or 'none'}, config.json gives {_groups(want) or 'none'}"))
  if not _same(_gain(cfg), _gain(want)):
    found.append(("rope_attention_scaling", f"rope q/k gain: the model has {_gain(cfg):.6g}, config.json gives "
                  f"{_gain(want):.6g} (rope_attention_scaling={format_value(keys['rope_attention_scaling'])})"))
  if not math.isclose(cfg.softmax_scale, want.softmax_scale, rel_tol=1e-9):
    found.append(("mscale", f"softmax scale: the model has {cfg.softmax_scale:.6g}, config.json gives "
                  f"{want.softmax_scale:.6g} (mscale={format_value(keys['mscale'])}, max_position_embeddings="
                  f"{keys['max_position_embeddings']}, original_max_position_embeddings="
                  f"{keys['original_max_position_embeddings']})"))
  return found


def _conflicts_v4(cfg, want, keys: dict[str, Any], path: str) -> list[tuple[str, str]]:
  found = []
  for attr, key in hf_config_v4.COMPARED:
    ours, theirs = getattr(cfg, attr), getattr(want, attr)
    if _same(ours, theirs) or (attr == "routed_bias" and (ours or not _nonzero_bias(path))):
      continue
    shown = keys.get(key, theirs)
    found.append((key, f"{attr}: the model has {format_value(ours)}, config.json gives {key}={format_value(shown)}"))
  if cfg.decoder_block == want.decoder_block:
    found += hf_config_v4.layout_conflicts(cfg, keys)
  return found


def check_keys(cfg, path: str, derived: dict[str, Any] | None = None) -> None:
  """Refuses a model that computes differently from the directory's config.json (`hf_config.conflicts`; `derived`:
  its `derive_keys`, when the caller has them), naming the config.json value; fewer MTP layers than stored is
  allowed (the rest is unused)."""
  keys = derive_keys(path) if derived is None else derived
  found = [(key, text) for key, text in conflicts(cfg, keys, path)
           if not (key == "mtp_num_layers" and cfg.mtp_num_layers < keys["mtp_num_layers"])]
  if found:
    more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
    raise errors.ConfigError(f"the model does not compute as {path} does: {found[0][1]}{more}; "
                             f"'inspect_checkpoint hf --path {path} --keys' prints every key it determines")
