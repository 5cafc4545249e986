"""MaxText 0.2.5's config keys: their defaults (`maxtext_data/base_keys.txt`), value typing, and what each does here.

Every key of MaxText's `base.yml` is accepted. `ModelConfig` fields are the keys this tool models; the others
(sharding, schedules, paths, logging, ...) are kept as typed values, echoed, and never change an output — except
the `UNMODELLED` keys, which change MaxText's DeepSeek tree or math in a way this tool does not model: those are
accepted only at MaxText's default, and refused with one line otherwise.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any, Iterable

import yaml

from inspect_tool import errors
from quant import settings
from quant import yaml_file

BASE_KEYS_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "maxtext_data", "base_keys.txt")

# Fields that shape the parameter tree (names, shapes, dtypes) of `inspect_checkpoint maxtext`.
TREE_KEYS = frozenset({
    "model_name", "model_file", "override_model_config", "decoder_block", "attention_type", "enable_nnx",
    "global_parameter_scale", "base_emb_dim", "base_num_query_heads", "base_num_kv_heads", "base_mlp_dim",
    "base_moe_mlp_dim", "base_num_decoder_layers", "first_num_dense_layers", "vocab_size", "q_lora_rank",
    "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "num_experts", "shared_experts",
    "routed_bias", "mtp_num_layers", "logits_via_embedding", "scan_layers", "param_scan_axis", "weight_dtype",
    # DeepSeek-V3.2 / V4 / custom architectures.
    "use_indexer", "indexer_n_heads", "indexer_head_dim", "mhc_expansion_rate", "engram_layers", "compress_ratios",
    "o_groups", "o_lora_rank", "first_num_hash_layers",
    "head_dim",  # DeepSeek-V4's compressed attention and compressors (MLA's shapes come from qk_nope/qk_rope/v_head_dim)
})

# Fields that change no output of this tool, and why (MaxText uses them for evaluation, memory or training only).
NO_EFFECT_FIELDS = {
    "mtp_eval_target_module": "an evaluation metric (MTP acceptance rate), not the model",
    "num_vocab_tiling": "a memory tiling of the loss; the logits are the same",
    "dropout_rate": "no parameters; the forward pass here is deterministic, dropout off",
    "enable_dropout": "no parameters; the forward pass here is deterministic, dropout off",
    "mtp_reuse_input_embedding": "MaxText shifts the main token embeddings instead of looking the shifted tokens up "
                                 "again: one lookup, the same values",
}

# Keys MaxText's DeepSeek model reads that change its tree or math, which this tool does not model.
UNMODELLED = {
    "mlp_bias": "adds bias parameters to the MLPs",
    "moe_expert_input_dim": "changes the expert input width",
    "fused_mlp": "fuses the MLP input projections",
    "fused_qkv": "fuses the attention projections",
    "share_kv_projections": "shares key and value projections",
    "mlp_activations_limit": "clips the SwiGLU activations",
    "norm_topk_prob": "renormalises the top-k routing weights",
    "use_random_routing": "routes tokens at random",
    "attn_logits_soft_cap": "soft-caps attention logits",
    "final_logits_soft_cap": "soft-caps the output logits",
    "float32_logits": "computes attention logits in float32",
    "activations_in_float32": "keeps activations in float32",
    "normalize_embedding_logits": "normalises the embedding before the logits",
    "attention_sink": "adds attention-sink parameters",
    "sliding_window_size": "restricts attention to a window",
    "use_untrainable_positional_embedding": "adds a positional embedding",
    "trainable_position_size": "adds a trainable position embedding",
    "interleave_moe_layer_step": "interleaves dense and MoE layers differently",
    "load_balance_loss_weight": "adds the load-balancing loss",
    "use_multimodal": "adds a vision encoder",
    "use_audio": "adds an audio encoder",
    "partial_rotary_factor": "changes the rotary dimension",
    "rope_linear_scaling_factor": "scales RoPE positions",
    "use_mrope": "uses multimodal RoPE",
    "weight_block_size": "stores fp8 weights with block scales",
    "model_call_mode": "selects the inference paths (e.g. softmax-probability token dropping)",
    "checkpoint_is_quantized": "loads AQT-quantized serving weights (another parameter tree)",
    "use_manual_quantization": "quantizes the batch-split model by hand instead of through Qwix rules",
    "ici_pipeline_parallelism": "wraps the decoder layers in a pipeline module (parameters stacked by stage)",
    "dcn_pipeline_parallelism": "wraps the decoder layers in a pipeline module (parameters stacked by stage)",
}


# Keys the sharding plan and per-device memory (`maxtext --devices/--topology`) read besides the tree's: the mesh
# (with every `ici_*` / `dcn_*_parallelism` key), the logical-axis rules, the optimizer state.
SHARDING_KEYS = frozenset({
    "mesh_axes", "num_slices", "compile_topology_num_slices", "custom_mesh_and_rule", "logical_axis_rules",
    "override_logical_axis_rules", "shard_exp_on_fsdp", "use_2d_fsdp_sharding", "use_batch_split_schedule",
    "use_lineage", "shard_optimizer_over_data", "mu_dtype", "opt_type",
    "per_device_batch_size", "remat_policy",  # the activation estimate of the fit check (--train)
    "indexer_sparse_training",  # ... whether the step has a main loss (an indexer's dense warm-up has none)
})
# Fields of `quant.settings.QuantSettings` that choose a kernel, not a rule.
_KERNEL_FIELDS = frozenset({"gmm_backend", "use_tokamax_backend"})

# What a key changes here (`inspect_checkpoint keys`), most structural first.
AFFECTS = {
    "tree": "shapes the parameter tree (every command)",
    "forward": "the forward pass: forward, export's validation, the rules trace",
    "rules": "which Qwix rules are built: rules, a quantized forward, export",
    "sharding": "the sharding plan and per-device memory of maxtext --devices/--topology",
    "ignored": "accepted and kept (in --format json's config); changes no output",
    "refused": "accepted only at MaxText's default: this tool does not model it",
}


def affects(key: str, fields) -> tuple[str, str]:
  """(an `AFFECTS` kind, why or '') for `key`; `fields` are the model config's field names."""
  if key in UNMODELLED:
    return "refused", f"in MaxText it {UNMODELLED[key]}"
  if key in TREE_KEYS:
    return "tree", ""
  if key in NO_EFFECT_FIELDS:
    return "ignored", NO_EFFECT_FIELDS[key]
  if key in ("per_device_batch_size", "remat_policy"):
    return "sharding", "the activation estimate of the fit check (--train); forward's batch comes from --tokens"
  if key in {f.name for f in dataclasses.fields(settings.QuantSettings)} - _KERNEL_FIELDS:
    return "rules", ""
  if key in fields and key != "passthrough":
    return "forward", ""
  if key in SHARDING_KEYS or (key.startswith(("ici_", "dcn_")) and key.endswith("_parallelism")):
    return "sharding", ""
  return "ignored", ""


def _yaml_load(text: str):
  return yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


@functools.lru_cache(maxsize=None)
def defaults() -> dict[str, Any]:
  """Every MaxText 0.2.5 base.yml key → its default (`None` for base.yml's `None`/`null`)."""
  with open(BASE_KEYS_FILE, encoding="utf-8") as f:
    data = _yaml_load(f.read())
  return {key: None if value == "None" else value for key, value in data.items()}


def is_key(key: str) -> bool:
  return key in defaults()


_KINDS = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list", dict: "a mapping"}


class _NotYaml(Exception):
  """A command-line value that is not YAML (taken as a plain string)."""


def parse(key: str, value: Any) -> Any:
  """Types a value (command-line text or YAML value) like MaxText's default for `key`."""
  default = defaults()[key]
  text = value if isinstance(value, str) else None
  if isinstance(default, str) and text is not None:
    return text.strip().strip("'\"")
  if text is not None:
    try:
      value = yaml_file.loads(text, f"{key}={errors.shown(text)}", errors.ConfigError, _NotYaml) if text.strip() \
          else ""
    except _NotYaml:  # a plain string then
      value = text
  if default is None or value is None:
    return value
  kind = type(default)
  if kind in (int, float) and isinstance(value, str):
    try:
      value = float(value.replace("_", ""))
    except ValueError:
      pass
  if kind is bool and value in (0, 1) and not isinstance(value, bool):
    return bool(value)
  if kind is float and isinstance(value, int) and not isinstance(value, bool):
    return float(value)
  if kind is int and isinstance(value, float) and value.is_integer():
    return int(value)
  if kind is str and isinstance(value, (int, float, bool)):
    return str(value if text is None else text.strip())
  if isinstance(value, kind) and not (kind in (int, float) and isinstance(value, bool)):
    return value
  raise errors.ConfigError(f"{key}={errors.shown(value if text is None else text)} is not "
                           f"{_KINDS.get(kind, kind.__name__)} (MaxText's default: {errors.shown(default)})")


def check_modelled(values: dict[str, Any]) -> None:
  """Refuses an `UNMODELLED` key set to anything but MaxText's default, in one line."""
  for key, value in values.items():
    if key in UNMODELLED and value != defaults()[key] and not (value in ([], None) and not defaults()[key]):
      raise errors.ConfigError(
          f"{key}={errors.shown(value)} is not supported: in MaxText it {UNMODELLED[key]}, which this tool does not "
          f"model; accepted: {errors.shown(defaults()[key])} (MaxText's default)")


def describe(keys: Iterable[str], fields: Iterable[str]) -> list[str]:
  """`--verbose` lines: which of `keys` shape the parameter tree, which only the forward pass, which nothing."""
  fields = set(fields) - {"passthrough"}
  tree, forward, none, ignored = [], [], [], []
  for key in sorted(set(keys)):
    if key in TREE_KEYS:
      tree.append(key)
    elif key in NO_EFFECT_FIELDS:
      none.append(f"{key} ({NO_EFFECT_FIELDS[key]})")
    elif key in fields:
      forward.append(key)
    else:
      ignored.append(key)
  lines = []
  if tree:
    lines.append("keys that shape the parameter tree: " + ", ".join(tree))
  if forward:
    lines.append("accepted, ignored for structure (used by forward, rules and export): " + ", ".join(forward))
  if none:
    lines.append("accepted, ignored for structure and by the forward pass: " + "; ".join(none))
  if ignored:
    lines.append("accepted, ignored for structure (MaxText training, sharding, schedule, path or logging keys; "
                 "kept in --format json's config): " + ", ".join(ignored))
  return lines
