"""Model configuration: MaxText's keys, presets and `key=value` overrides (the rules they must meet: `validation`).

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

from inspect_tool import errors
from inspect_tool.configuration import maxtext_keys
from inspect_tool.configuration import presets
from inspect_tool.configuration import validation
from quant import settings
from quant import yaml_file

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
    validation.validate(self)

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
    raise errors.ConfigError(f"{key}={errors.shown(text)} is not a valid {kind}")
  value = text.strip()
  if kind == "bool":
    if value.lower() in _TRUE:
      return True
    if value.lower() in _FALSE:
      return False
    raise errors.ConfigError(f"{key}={errors.shown(text)} is not a boolean; accepted: true, false, True, False, 1, 0")
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
      raise errors.ConfigError(f"{key}={errors.shown(text)} is not an integer") from None
  if kind == "float":
    try:
      return float(value.replace("_", ""))
    except ValueError:
      raise errors.ConfigError(f"{key}={errors.shown(text)} is not a number") from None
  return value.strip("'\"")


def parse_overrides(tokens: Iterable[str]) -> dict[str, str]:
  """Splits `key=value` tokens (raw strings). A token without `=` or with an empty key is refused."""
  raw: dict[str, str] = {}
  for token in tokens:
    key, sep, value = token.partition("=")
    key = key.strip()
    if not sep or not key:
      raise errors.ConfigError(f"argument {errors.shown(token)} is not of the form key=value "
                               "(e.g. model_name=deepseek3-671b)")
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
    try:
      return _typed(data)
    except errors.ConfigError as e:  # the key is in the file, not on the command line: say where
      e.args = (f"model file {model_file!r}: {e}",)
      raise e from None
  if model_name == "default":
    return {}
  try:
    data = presets.load(model_name)
  except KeyError as e:
    raise errors.ConfigError(e.args[0]) from None
  return dict(_typed(data), model_name=model_name)


def _bare_model_files(tokens: list[str]) -> list[str]:
  return [t for t in tokens if "=" not in t and t.endswith((".yml", ".yaml")) and os.path.basename(t) != "base.yml"]


def model_files(tokens: Iterable[str]) -> list[str]:
  """The user model files that key=value `tokens` name (bare `*.yml` paths, `model_file=PATH`): inputs of the
  command, which no output may replace."""
  tokens = list(tokens)
  return _bare_model_files(tokens) + [t.partition("=")[2] for t in tokens if t.startswith("model_file=")]


def resolve_config(tokens: Iterable[str] = (), **extra: Any) -> ModelConfig:
  """Builds a `ModelConfig` from MaxText-style `key=value` tokens (plus typed keyword overrides).

  `model_file=<path.yml>` (or a bare `*.yml` token) names a user model file used in place of a preset. MaxText's
  own first argument, its `.../configs/base.yml`, is skipped: its keys and defaults are built in.
  """
  tokens = [t for t in tokens if "=" in t or os.path.basename(t) != "base.yml"]
  files = _bare_model_files(tokens)
  raw = parse_overrides([t for t in tokens if t not in files])
  given_files = files + ([raw["model_file"]] if "model_file" in raw else [])
  if len(given_files) > 1:  # MaxText reads one model file: name a missing or bad one first, then refuse the second
    for path in given_files:
      load_model_file(path)
    raise errors.ConfigError(f"{len(given_files)} model files given ({', '.join(map(repr, given_files))}); a model "
                             "is read from one: give one model file (model_file=<path.yml> or a bare path)")
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
            f"{key}={errors.shown(value)} is set by model {base.get('model_name', model_name)!r} to "
            f"{errors.shown(base[key])}; "
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


def routed_fraction(cfg: ModelConfig) -> float:
  """The share of routed experts one token uses (`num_experts_per_tok / num_experts`)."""
  return cfg.num_experts_per_tok / cfg.num_experts


def model_source(tokens) -> str:
  """How a listing or diff names a model given by key=value tokens: `maxtext k=v ...`."""
  return "maxtext " + " ".join(tokens)
