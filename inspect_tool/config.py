"""Model configuration: MaxText's keys, presets, `key=value` overrides and MaxText's validation rules.

`resolve_config(["model_name=deepseek3-671b", "mtp_num_layers=1"])` returns a frozen `ModelConfig`.
Resolution order is MaxText's: defaults (base.yml) < preset or user YAML model file < command-line keys;
a key set by the model file and again on the command line with another value is refused unless
`override_model_config=true`. Every MaxText 0.2.5 key is accepted: the fields below are the keys this tool
models; any other MaxText key is kept, typed, in `cfg.passthrough` and readable as an attribute
(`cfg.ici_fsdp_parallelism`, `cfg.logical_axis_rules`: the value given, or MaxText's default).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
from typing import Any, Iterable, Mapping

from inspect_tool import errors, limits, maxtext_keys, presets
from quant import settings
from quant import yaml_file

QUANTIZATION_MODES = settings.QUANTIZATION_MODES
DTYPES = ("float32", "bfloat16", "float16")
SCORE_FUNCS = ("sigmoid", "softmax", "sqrtsoftplus")  # sqrtsoftplus: DeepSeek-V4
# Model names whose gate bias is MaxText's non-Param `MoEBiasVar` and which use DeepSeek-V3 routing.
DEEPSEEK_ROUTING_PREFIXES = ("deepseek3", "deepseek4", "kimi-k2")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig(settings.QuantSettings):
  """A DeepSeek-family model as MaxText configures it; field names are MaxText's keys."""

  # Identity.
  model_name: str = "default"
  decoder_block: str = "deepseek"
  attention_type: str = "mla"
  enable_nnx: bool = True
  override_model_config: bool = False

  # Sizes before `global_parameter_scale` (MaxText's base_* keys).
  global_parameter_scale: int = 1
  base_emb_dim: int = 2048
  base_num_query_heads: int = 16
  base_num_kv_heads: int = 16
  base_mlp_dim: int = 7168
  base_moe_mlp_dim: int = 7168
  base_num_decoder_layers: int = 16
  first_num_dense_layers: int = 0
  head_dim: int = 128  # unused by MLA shapes
  vocab_size: int = 32_000

  # MLA attention.
  q_lora_rank: int = 0  # 0: a single `query` projection
  kv_lora_rank: int = 512
  qk_nope_head_dim: int = 128
  qk_rope_head_dim: int = 64
  v_head_dim: int = 128
  float32_qk_product: bool = False

  # Mixture of experts.
  num_experts: int = 1
  num_experts_per_tok: int = 1
  shared_experts: int = 0
  routed_scaling_factor: float = 1.0
  routed_score_func: str = ""
  routed_bias: bool = False
  n_routing_groups: int = -1
  topk_routing_group: int = -1
  float32_gate_logits: bool = False
  float32_weight_sum: bool = True
  sparse_matmul: bool = True
  megablox: bool = True
  capacity_factor: float = -1.0

  # DeepSeek-V3.2 sparse attention indexer (MLA's `self_attention/indexer`; MaxText's defaults; issue 10).
  use_indexer: bool = False
  indexer_n_heads: int = 64
  indexer_head_dim: int = 128  # its first qk_rope_head_dim dims get RoPE
  indexer_topk: int = 2048  # keys kept per query; with this many keys or fewer every key is kept
  indexer_mask_exact_topk: bool = True  # ties at the cut-off: earliest positions first, exactly topk kept
  indexer_use_approx_top_k: bool = False
  indexer_approx_top_k_recall: float = 0.95
  # Manifold-constrained hyper-connections (k residual streams; 1: off) and Engram memory layers (issue 10).
  mhc_expansion_rate: int = 1
  engram_layers: tuple[str, ...] = ()  # layer indices; engram itself is not built (MaxText sizes it from a tokenizer)
  # DeepSeek-V4 (`decoder_block: deepseek4`, `attention_type: compressed`; MaxText's defaults; issue 10).
  compress_ratios: tuple[str, ...] = ()  # per layer: 0 (sliding window only), 4 (CSA), > 4 (HCA)
  o_groups: int = 0  # grouped low-rank output projection: groups and rank
  o_lora_rank: int = 0
  first_num_hash_layers: int = 0  # leading layers that route tokens by id
  sliding_window_size: int = 0  # uncompressed keys each query sees (compressed attention only; 0: all)
  compressed_rope_max_timescale: int = 160_000  # RoPE theta of layers with a compressor
  mlp_activations_limit: float = -1.0  # > 0: routed experts clip their gate (above) and up (both sides) values
  load_balance_loss_weight: float = 0.0  # a training loss term only: the logits do not depend on it
  norm_topk_prob: bool = False  # no effect on DeepSeek blocks: they renormalise sigmoid / sqrtsoftplus weights anyway

  # Multi-token prediction.
  mtp_num_layers: int = 0
  mtp_loss_scaling_factor: float = 0.1
  mtp_eval_target_module: int = 0
  mtp_reuse_input_embedding: bool = False

  # Layers, norms, activations.
  mlp_activations: tuple[str, ...] = ("silu", "linear")
  normalization_layer_epsilon: float = 1e-5
  logits_via_embedding: bool = False
  logits_dot_in_fp32: bool = False
  cast_logits_to_fp32: bool = True
  num_vocab_tiling: int = 1
  enable_dropout: bool = True
  dropout_rate: float = 0.0

  # RoPE (YaRN).
  rope_type: str = "default"
  rope_max_timescale: int = 10_000
  max_position_embeddings: int = 163840
  original_max_position_embeddings: int = 4096
  rope_factor: float = 40
  beta_fast: float = 32
  beta_slow: float = 1
  mscale: float = 1.0
  rope_interleave: bool = True
  rope_truncate: bool = True
  rope_attention_scaling: bool = False

  # Numerics and layout.
  dtype: str = "bfloat16"  # activations / compute
  weight_dtype: str = "float32"  # parameter storage
  matmul_precision: str = "default"
  scan_layers: bool = True
  param_scan_axis: int = 1
  init_weights_seed: int = 0
  attention: str = "autoselected"

  # Batch (used by the traced forward pass of coverage and by `forward` limits).
  max_target_length: int = 2048
  per_device_batch_size: float = 12.0

  # Quantization keys (quantization, quantize_mtp, ...) come from `quant.settings.QuantSettings`.
  use_qwix_quantization: bool = True  # MaxText's default is false (its deprecated AQT path); this tool models Qwix

  # Every other MaxText key set by the preset, the model file or the command line, typed (not compared or hashed:
  # none of them changes the model).
  passthrough: Mapping[str, Any] = dataclasses.field(default_factory=dict, compare=False, repr=False)

  def __post_init__(self):
    _validate(self)

  def __getattr__(self, name: str) -> Any:
    """Any MaxText key that is not a field: its value in `passthrough`, else MaxText's default."""
    if name.startswith("_") or name == "passthrough":
      raise AttributeError(name)
    passthrough = self.__dict__.get("passthrough", {})
    if name in passthrough:
      return passthrough[name]
    if maxtext_keys.is_key(name):
      return copy.deepcopy(maxtext_keys.defaults()[name])
    raise AttributeError(f"{type(self).__name__!r} has no MaxText key {name!r}")

  # Derived sizes (MaxText's global_parameter_scale rule; all equal base_* at scale 1).
  @property
  def _scales(self) -> tuple[int, int, int]:
    log2 = int(math.log2(self.global_parameter_scale))
    base, rem = divmod(log2, 3)
    head_scale = base + int(rem > 0)
    emb_scale = base + int(rem > 1)
    return emb_scale, head_scale, base

  @property
  def emb_dim(self) -> int:
    return 2 ** self._scales[0] * self.base_emb_dim

  @property
  def num_query_heads(self) -> int:
    return 2 ** self._scales[1] * self.base_num_query_heads

  @property
  def num_kv_heads(self) -> int:
    return 2 ** self._scales[1] * self.base_num_kv_heads

  @property
  def mlp_dim(self) -> int:
    return 2 ** self._scales[1] * self.base_mlp_dim

  @property
  def moe_mlp_dim(self) -> int:
    return 2 ** self._scales[1] * self.base_moe_mlp_dim

  @property
  def num_decoder_layers(self) -> int:
    return 2 ** self._scales[2] * self.base_num_decoder_layers

  @property
  def num_moe_layers(self) -> int:
    return self.num_decoder_layers - self.first_num_dense_layers

  @property
  def qk_head_dim(self) -> int:
    return self.qk_nope_head_dim + self.qk_rope_head_dim

  @property
  def deepseek_routing(self) -> bool:
    """True for model names whose gate bias is `MoEBiasVar` and that select experts on biased scores."""
    return self.model_name.startswith(DEEPSEEK_ROUTING_PREFIXES)

  @property
  def softmax_scale(self) -> float:
    """MLA's query scale: (dn+dr)^-0.5, times mscale² under YaRN context extension."""
    scale = self.qk_head_dim ** -0.5
    if self.max_position_embeddings > self.original_max_position_embeddings:
      m = 0.1 * self.mscale * math.log(self.rope_factor) + 1.0
      scale *= m * m
    return scale

  def replace(self, **changes: Any) -> "ModelConfig":
    return dataclasses.replace(self, **changes)


FIELDS = {f.name: f for f in dataclasses.fields(ModelConfig)}


def _check(ok: bool, message: str) -> None:
  if not ok:
    raise errors.ConfigError(message)


def _validate(c: ModelConfig) -> None:
  """MaxText's rules that matter here; each message names the value and what is accepted."""
  _check(c.enable_nnx, "enable_nnx=false is not supported: this tool builds Flax NNX models only "
         "(the parameter tree is the same as MaxText's Linen checkpoint layout); use enable_nnx=true")
  _check(c.decoder_block in ("deepseek", "deepseek4"),
         f"decoder_block={c.decoder_block!r} is not supported; accepted: 'deepseek', 'deepseek4'")
  expected_attention = "compressed" if c.decoder_block == "deepseek4" else "mla"
  _check(c.attention_type == expected_attention, f"attention_type={c.attention_type!r} is not supported with "
         f"decoder_block={c.decoder_block!r}; accepted: {expected_attention!r}")
  if c.decoder_block == "deepseek4":
    _validate_deepseek4(c)
  gps = c.global_parameter_scale
  _check(gps >= 1 and (gps & (gps - 1)) == 0, f"global_parameter_scale={gps} must be a power of two >= 1")
  for name in ("base_emb_dim", "base_num_query_heads", "base_num_kv_heads", "base_mlp_dim", "base_moe_mlp_dim",
               "base_num_decoder_layers", "vocab_size", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
               "v_head_dim", "num_experts", "num_experts_per_tok", "max_target_length"):
    value = getattr(c, name)
    _check(value > 0, f"{name}={value} must be a positive integer")
  for name in ("first_num_dense_layers", "q_lora_rank", "shared_experts", "mtp_num_layers"):
    value = getattr(c, name)
    _check(value >= 0, f"{name}={value} must be >= 0")
  _check(c.qk_rope_head_dim % 2 == 0, f"qk_rope_head_dim={c.qk_rope_head_dim} must be even")
  _check(c.first_num_dense_layers <= c.num_decoder_layers,
         f"first_num_dense_layers={c.first_num_dense_layers} exceeds num_decoder_layers={c.num_decoder_layers}")
  _check(c.num_experts == 1 or c.first_num_dense_layers > 0 or c.base_mlp_dim == c.base_moe_mlp_dim,
         f"a fully MoE model (first_num_dense_layers=0) needs base_mlp_dim == base_moe_mlp_dim "
         f"(got {c.base_mlp_dim} and {c.base_moe_mlp_dim})")
  _check(c.num_experts_per_tok <= c.num_experts,
         f"num_experts_per_tok={c.num_experts_per_tok} exceeds num_experts={c.num_experts}")
  _check(c.param_scan_axis in (0, 1), f"param_scan_axis={c.param_scan_axis}; accepted: 0, 1")
  _check(c.routed_score_func in SCORE_FUNCS + ("",),
         f"routed_score_func={c.routed_score_func!r}; accepted: {', '.join(SCORE_FUNCS)}")
  _check(c.dtype in DTYPES, f"dtype={c.dtype!r}; accepted: {', '.join(DTYPES)}")
  _check(c.weight_dtype in DTYPES, f"weight_dtype={c.weight_dtype!r}; accepted: {', '.join(DTYPES)}")
  _check(tuple(c.mlp_activations) in (("silu", "linear"),),
         f"mlp_activations={list(c.mlp_activations)}; accepted: ['silu', 'linear']")
  _check(c.n_routing_groups == -1 or (c.n_routing_groups > 0 and c.num_experts % c.n_routing_groups == 0
                                      and 0 < c.topk_routing_group <= c.n_routing_groups),
         f"n_routing_groups={c.n_routing_groups} topk_routing_group={c.topk_routing_group}: groups must divide "
         f"num_experts={c.num_experts} and 0 < topk_routing_group <= n_routing_groups (or both -1)")
  _check(c.quantization in QUANTIZATION_MODES,
         f"quantization={c.quantization!r}; accepted: {', '.join(repr(q) for q in QUANTIZATION_MODES)}")
  _check(not c.quantization or c.use_qwix_quantization,
         f"use_qwix_quantization=false with quantization={c.quantization!r} selects MaxText's AQT path, which this "
         "tool does not model; accepted: use_qwix_quantization=true (Qwix, this tool's default)")
  _check(not (c.quantization and c.use_batch_split_schedule),
         f"quantization={c.quantization!r} with use_batch_split_schedule=true: MaxText's batch-split DeepSeek model "
         "quantizes through its own fp8 path, not Qwix rules, which this tool does not model; accepted: "
         "use_batch_split_schedule=false (with override_model_config=true on a batch-split preset)")
  if c.quantization:
    _validate_calibrations(c)
  if c.quantize_mtp:
    _check(c.mtp_num_layers > 0, "quantize_mtp=true needs mtp_num_layers > 0 (got mtp_num_layers=0)")
    _check(c.quantization == "fp8_full",
           f"quantize_mtp=true needs quantization=fp8_full (got quantization={c.quantization!r})")
  if c.quantize_logits_proj:
    _check(c.quantization == "fp8_full",
           f"quantize_logits_proj=true needs quantization=fp8_full (got quantization={c.quantization!r})")
    _check(not c.logits_via_embedding, "quantize_logits_proj=true needs logits_via_embedding=false")
    _check(c.num_vocab_tiling == 1, f"quantize_logits_proj=true needs num_vocab_tiling=1 (got {c.num_vocab_tiling})")
    _check(not c.logits_dot_in_fp32, "quantize_logits_proj=true needs logits_dot_in_fp32=false")
  _check(not (c.quantization and c.quantize_router_proj and c.float32_gate_logits),
         "float32_gate_logits=true cannot be combined with a quantized router; set quantize_router_proj=false")
  _check(c.weight_sparsity_n is None or (c.weight_sparsity_m or 0) > (c.weight_sparsity_n or 0) > 0,
         f"weight_sparsity_n={c.weight_sparsity_n} weight_sparsity_m={c.weight_sparsity_m}: need 0 < n < m")
  if c.use_indexer:  # DeepSeek-V3.2 (issue 10)
    _check(c.q_lora_rank > 0, "use_indexer=true needs q_lora_rank > 0 (the indexer's query reads MLA's query latent)")
    for name in ("indexer_n_heads", "indexer_topk"):
      _check(getattr(c, name) > 0, f"{name}={getattr(c, name)} must be a positive integer")
    _check(c.indexer_head_dim >= c.qk_rope_head_dim,
           f"indexer_head_dim={c.indexer_head_dim} must be >= qk_rope_head_dim={c.qk_rope_head_dim}")
  _check(c.mhc_expansion_rate >= 1, f"mhc_expansion_rate={c.mhc_expansion_rate} must be >= 1")
  _check(not c.engram_layers, f"engram_layers={list(c.engram_layers)} is not supported: Engram layers are sized from "
         "a Hugging Face tokenizer (MaxText needs tokenizer_path and hf_access_token); accepted: "
         "override_model_config=true engram_layers=[]")
  _check(not (c.mhc_expansion_rate > 1 and c.mtp_num_layers > 0),
         f"mtp_num_layers={c.mtp_num_layers} with mhc_expansion_rate={c.mhc_expansion_rate}: MaxText 0.2.5's MTP layer "
         "receives the reduced hidden state while its mHC layer expects the expanded streams, so MaxText fails; "
         "accepted: mtp_num_layers=0")
  _check(c.mtp_eval_target_module <= c.mtp_num_layers,
         f"mtp_eval_target_module={c.mtp_eval_target_module} exceeds mtp_num_layers={c.mtp_num_layers}")
  limits.check_config(c)  # finite numbers, buildable sizes (inspect_tool/limits.py)


def _validate_deepseek4(c: ModelConfig) -> None:
  """DeepSeek-V4: MaxText's own rules plus what its model needs to build."""
  _check(c.mtp_num_layers == 0, f"mtp_num_layers={c.mtp_num_layers}: DeepSeek4 decoder block currently does not "
         "support MTP layers (MaxText 0.2.5); accepted: mtp_num_layers=0")
  _check(c.mhc_expansion_rate > 1, f"mhc_expansion_rate={c.mhc_expansion_rate}: MaxText's DeepSeek-V4 layer always "
         "applies mHC; accepted: mhc_expansion_rate >= 2")
  ratios = []
  for value in c.compress_ratios:
    _check(str(value).isdigit() and (int(value) == 0 or int(value) >= 4),
           f"compress_ratios entry {value!r}: compress_ratio must be 0 (disabled) or >= 4")
    ratios.append(int(value))
  needed = c.num_decoder_layers if not c.scan_layers else c.first_num_hash_layers
  _check(len(ratios) >= needed, f"compress_ratios has {len(ratios)} entries; {needed} layers need one each")
  _check(0 <= c.first_num_hash_layers <= c.num_decoder_layers,
         f"first_num_hash_layers={c.first_num_hash_layers} must be within 0..num_decoder_layers={c.num_decoder_layers}")
  _check(c.num_kv_heads == 1, f"base_num_kv_heads={c.base_num_kv_heads}: compressed attention has one key/value "
         "head (the compressed blocks are one head); accepted: 1")
  for name in ("q_lora_rank", "o_groups", "o_lora_rank"):
    _check(getattr(c, name) > 0, f"{name}={getattr(c, name)} must be a positive integer with decoder_block=deepseek4")
  _check(c.num_query_heads * c.head_dim % c.o_groups == 0,
         f"o_groups={c.o_groups} must divide num_query_heads*head_dim={c.num_query_heads * c.head_dim}")
  _check(0 < c.qk_rope_head_dim <= c.head_dim and c.qk_rope_head_dim % 2 == 0,
         f"qk_rope_head_dim={c.qk_rope_head_dim} must be even and within 1..head_dim={c.head_dim}")


def _validate_calibrations(c: ModelConfig) -> None:
  """The calibration methods the quantized run accepts (symmetric: absmax, rms,<f>, fixed,<hi>), checked up front."""
  from quant import errors as quant_errors  # pylint: disable=import-outside-toplevel
  from quant import fp8  # pylint: disable=import-outside-toplevel

  for name in ("weight_quantization_calibration_method", "act_quantization_calibration_method",
               "bwd_quantization_calibration_method", "logits_proj_quant_calibration_method",
               "drhs_grad_quantization_calibration_method"):
    value = getattr(c, name)
    if not value:
      continue
    try:
      fp8.parse_calibration(value)
    except quant_errors.QuantError:
      raise errors.ConfigError(
          f"{name}={value!r} is not supported with quantization={c.quantization!r}: the run quantizes "
          f"symmetrically; accepted: {', '.join(fp8.CALIBRATIONS)}") from None


# ---------------------------------------------------------------------------------------------------------
# key=value parsing: strings to typed values, nothing more.

_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def _field_kind(name: str) -> str:
  default = FIELDS[name].default
  annotation = str(FIELDS[name].type)
  if isinstance(default, bool):
    return "bool"
  if isinstance(default, tuple):
    return "list"
  if isinstance(default, int) or annotation.startswith("int"):
    return "int"
  if isinstance(default, float):
    return "float"
  return "str"


def parse_value(key: str, text: Any) -> Any:
  """Converts one override value (a string from the command line, or a YAML value) to the key's type."""
  kind = _field_kind(key)
  if not isinstance(text, str):  # YAML already typed it
    if kind == "list" and isinstance(text, (list, tuple)):
      return tuple(str(t) for t in text)
    if kind == "float" and isinstance(text, int) and not isinstance(text, bool):
      return float(text)
    if kind == "int" and isinstance(text, float) and text.is_integer():
      return int(text)
    expected = {"bool": bool, "int": int, "float": float, "str": str, "list": (list, tuple)}[kind]
    if text is None and FIELDS[key].type.endswith("None"):
      return None
    if isinstance(text, expected) and not (kind in ("int", "float") and isinstance(text, bool)):
      return text
    raise errors.ConfigError(f"{key}={text!r} is not a valid {kind}")
  value = text.strip()
  if kind == "bool":
    if value.lower() in _TRUE:
      return True
    if value.lower() in _FALSE:
      return False
    raise errors.ConfigError(f"{key}={text!r} is not a boolean; accepted: true, false, True, False, 1, 0")
  if kind == "list":
    inner = value[1:-1] if value.startswith("[") and value.endswith("]") else value
    return tuple(part.strip().strip("'\"") for part in inner.split(",") if part.strip())
  if value.lower() in ("none", "null") and str(FIELDS[key].type).endswith("None"):
    return None
  if kind == "int":
    try:
      return int(value.replace("_", ""))
    except ValueError:
      try:
        as_float = float(value)
      except ValueError:
        as_float = None
      if as_float is not None and as_float.is_integer():
        return int(as_float)
      raise errors.ConfigError(f"{key}={text!r} is not an integer") from None
  if kind == "float":
    try:
      return float(value.replace("_", ""))
    except ValueError:
      raise errors.ConfigError(f"{key}={text!r} is not a number") from None
  return value.strip("'\"")


def parse_overrides(tokens: Iterable[str]) -> dict[str, str]:
  """Splits `key=value` tokens (raw strings). A token without `=` or with an empty key is refused."""
  raw: dict[str, str] = {}
  for token in tokens:
    key, sep, value = token.partition("=")
    key = key.strip()
    if not sep or not key:
      raise errors.ConfigError(f"argument {token!r} is not of the form key=value (e.g. model_name=deepseek3-671b)")
    raw[key] = value
  return raw


def known_keys() -> list[str]:
  return sorted(set(FIELDS) | set(maxtext_keys.defaults()))


def _typed(raw: Mapping[str, Any]) -> dict[str, Any]:
  """Types every value: a field by its type, another MaxText key like its MaxText default."""
  typed = {}
  for key, value in raw.items():
    if key in FIELDS and key != "passthrough":
      typed[key] = parse_value(key, value)
    elif maxtext_keys.is_key(key):
      typed[key] = maxtext_keys.parse(key, value)
    else:
      raise errors.UnknownKeyError(key, known_keys())
  return typed


def load_model_file(path: str) -> dict[str, Any]:
  """Reads a user YAML model file (MaxText model-yml keys) into a key → value mapping."""
  data = yaml_file.load(path, f"model file {path!r}", errors.ConfigError)
  if data is None:
    data = {}
  if not isinstance(data, dict):
    raise errors.ConfigError(f"model file {path!r} must hold a mapping of MaxText keys, got {type(data).__name__}")
  return data


def model_keys(model_name: str, model_file: str | None = None) -> dict[str, Any]:
  """The keys a preset (or a user model file) sets, typed."""
  if model_file:
    data = load_model_file(model_file)
    data.setdefault("model_name", model_name if model_name != "default" else
                    os.path.splitext(os.path.basename(model_file))[0])
    return _typed(data)
  if model_name == "default":
    return {}
  try:
    data = presets.load(model_name)
  except KeyError as e:
    raise errors.ConfigError(e.args[0]) from None
  return dict(_typed(data), model_name=model_name)


def resolve_config(tokens: Iterable[str] = (), **extra: Any) -> ModelConfig:
  """Builds a `ModelConfig` from MaxText-style `key=value` tokens (plus typed keyword overrides).

  `model_file=<path.yml>` (or a bare `*.yml` token) names a user model file used in place of a preset. MaxText's
  own first argument, its `.../configs/base.yml`, is skipped: its keys and defaults are built in.
  """
  tokens = [t for t in tokens if "=" in t or os.path.basename(t) != "base.yml"]
  files = [t for t in tokens if "=" not in t and t.endswith((".yml", ".yaml"))]
  raw = parse_overrides([t for t in tokens if t not in files])
  model_file = raw.pop("model_file", None) or (files[0] if files else None)
  cli = _typed(raw)
  cli.update(extra)
  if "model_name" not in cli and not model_file:
    raise errors.ConfigError(f"no model given: pass model_name=<one of {', '.join(presets.names())}>, "
                             "model_file=<your.yml>, or model_name=default for MaxText's base defaults")
  model_name = cli.get("model_name", "default")
  base = model_keys(model_name, model_file)
  if not cli.get("override_model_config", False):
    for key, value in cli.items():
      if key in base and key != "model_name" and base[key] != value:
        raise errors.ConfigError(
            f"{key}={value!r} is set by model {base.get('model_name', model_name)!r} to {base[key]!r}; "
            "add override_model_config=true to override model keys")
  merged = {**base, **cli}
  other = {key: merged.pop(key) for key in list(merged) if key not in FIELDS}
  maxtext_keys.check_modelled(other)
  return ModelConfig(**merged, passthrough=other)


def describe_keys(tokens: Iterable[str]) -> list[str]:
  """`--verbose`: which of the given keys (and of the model's other MaxText keys) shape the tree, which do not."""
  tokens = list(tokens)
  given = [key for key in parse_overrides(t for t in tokens if "=" in t)]
  cfg = resolve_config(tokens)
  lines = maxtext_keys.describe(given, FIELDS)
  from_model = sorted(set(cfg.passthrough) - set(given))
  if from_model:
    lines += [f"set by model {cfg.model_name!r}, ignored for structure: {', '.join(from_model)}"]
  return lines


def echo(cfg: ModelConfig) -> dict[str, Any]:
  """The config for `--format json`: every field, then every other MaxText key that was set."""
  out = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name != "passthrough"}
  out.update(sorted(cfg.passthrough.items()))
  return {key: list(value) if isinstance(value, tuple) else value for key, value in out.items()}
