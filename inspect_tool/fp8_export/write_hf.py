"""Export stage 4, `--layout deepseek-fp8`: Hugging Face DeepSeek safetensors in DeepSeek-V3's FP8 release layout.

`write_deepseek_fp8(arrays, cfg, dst_dir)` maps every MaxText leaf to its Hugging Face DeepSeek-V3 (or V2)
tensor(s), quantizes the Linear weights to float8_e4m3fn with one float32 `weight_scale_inv` per 128×128 block
(`dequantized = fp8 * weight_scale_inv`, blocks of the (out, in) matrix, edge blocks smaller), and writes
`model-0000k-of-0000n.safetensors` shards, `model.safetensors.index.json` and `config.json` (with DeepSeek's
`quantization_config`). DeepSeek-V3 routing (deepseek3* names, sigmoid) exports as `DeepseekV3ForCausalLM`,
plain softmax top-k without bias (deepseek2*) as `DeepseekV2ForCausalLM`; other routings are refused.

Letters: E emb_dim, H heads, qr/kr q/kv LoRA ranks, dn/dr/dv nope/rope/value head dims, dq = dn+dr,
F mlp_dim, Fm moe_mlp_dim, S shared experts, X experts, V vocab, L decoder layers, D dense layers,
M = L-D MoE layers, P MTP depths.

Choices (they follow DeepSeek-V3's official FP8 checkpoint):
* FP8 + `_scale_inv`: every attention projection, dense MLP, shared-expert and routed-expert weight, MTP
  transformer layers included.
* bfloat16: embeddings, `lm_head`, all RMSNorm weights, the router `mlp.gate.weight` and the MTP `eh_proj`
  (the release keeps eh_proj unquantized: serving stacks load it as a plain Linear). `e_score_correction_bias`
  stays float32 as in the release (bf16 rounding of the bias could change which experts are picked).
* MTP depth k is layer `L + k - 1` (`model.layers.61` for V3): enorm, hnorm, eh_proj, shared_head.norm and its
  MoE transformer layer. MaxText shares embedding and head with the main model; the release nevertheless
  stores copies as `model.layers.{L+k-1}.embed_tokens.weight` / `.shared_head.head.weight`, which serving
  loaders read, so copies are written (`mtp_shared_copies=False` leaves them out).
* Rope columns are written in Hugging Face's interleaved layout: identity for `rope_interleave=true` (MaxText
  consumes HF's layout as is); for `rope_interleave=false` MaxText pairs (i, i+dr/2), which becomes (2i, 2i+1).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from typing import Any, Callable, Iterator, Mapping

import ml_dtypes
import numpy as np

from inspect_tool import errors
from inspect_tool import tree

BLOCK = (128, 128)
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9
INDEX_NAME = "model.safetensors.index.json"
QUANTIZATION_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                       "weight_block_size": list(BLOCK)}

# How a leaf becomes Hugging Face tensors.
FP8 = "fp8"  # Linear kernel -> (out, in) float8_e4m3fn + <name>_scale_inv
EXPERTS_FP8 = "experts_fp8"  # (X, in, out) -> X Linear weights, one per expert
BF16_LINEAR = "bf16_linear"  # kernel (in, out) -> (out, in) bfloat16
BF16 = "bf16"  # as is, bfloat16 (norms, embedding)
F32 = "f32"  # as is, float32 (router bias)

_MOE = ("DeepSeekMoeBlock_0",)
_ROUTED = _MOE + ("MoeBlock_0",)


@dataclasses.dataclass(frozen=True)
class _Rule:
  """One per-layer (or top-level) leaf: target name(s), conversion, number of input axes, rope columns."""

  names: tuple[str, ...]  # `{i}` = HF layer index, `{j}` = expert
  kind: str
  n_in: int = 1  # leading kernel axes that are the Linear's input
  rope: bool = False  # the last dr output columns are rope (of each head's dq for q; of kr+dr for kv_a)


@dataclasses.dataclass(frozen=True)
class _Entry:
  """A MaxText leaf: its full shape, the HF layer of each stacked slice, the layer axis and its rule."""

  shape: tuple[int, ...]
  rule: _Rule
  layers: tuple[int, ...] = ()  # HF layer index per slice; () for a top-level tensor
  layer_axis: int | None = None  # None: one layer, not stacked


def _layer_rules(cfg, moe: bool) -> dict[tuple[str, ...], tuple[tuple[int, ...], _Rule]]:
  """Per-layer MaxText subpath -> (per-layer shape, rule), for a dense or a MoE decoder layer."""
  e, h, dn, dr, dv = cfg.emb_dim, cfg.num_query_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
  qr, kr = cfg.q_lora_rank, cfg.kv_lora_rank
  p = "model.layers.{i}."
  rules = {
      ("pre_self_attention_layer_norm", "scale"): ((e,), _Rule((p + "input_layernorm.weight",), BF16)),
      ("post_self_attention_layer_norm", "scale"): ((e,), _Rule((p + "post_attention_layernorm.weight",), BF16)),
      ("self_attention", "wkv_a", "kernel"): ((e, kr + dr), _Rule((p + "self_attn.kv_a_proj_with_mqa.weight",),
                                                                  FP8, rope=True)),
      ("self_attention", "kv_norm", "scale"): ((kr,), _Rule((p + "self_attn.kv_a_layernorm.weight",), BF16)),
      ("self_attention", "wkv_b", "kernel"): ((kr, h, dn + dv), _Rule((p + "self_attn.kv_b_proj.weight",), FP8)),
      ("self_attention", "out", "kernel"): ((h, dv, e), _Rule((p + "self_attn.o_proj.weight",), FP8, n_in=2)),
  }
  if qr:
    rules[("self_attention", "wq_a", "kernel")] = ((e, qr), _Rule((p + "self_attn.q_a_proj.weight",), FP8))
    rules[("self_attention", "q_norm", "scale")] = ((qr,), _Rule((p + "self_attn.q_a_layernorm.weight",), BF16))
    rules[("self_attention", "wq_b", "kernel")] = ((qr, h, dn + dr), _Rule((p + "self_attn.q_b_proj.weight",), FP8,
                                                                           rope=True))
  else:
    rules[("self_attention", "query", "kernel")] = ((e, h, dn + dr), _Rule((p + "self_attn.q_proj.weight",), FP8,
                                                                           rope=True))
  projections = (("wi_0", "gate_proj"), ("wi_1", "up_proj"), ("wo", "down_proj"))
  if not moe:
    f = cfg.mlp_dim
    for mt, hf in projections:
      rules[("mlp", mt, "kernel")] = ((e, f) if mt != "wo" else (f, e), _Rule((p + f"mlp.{hf}.weight",), FP8))
    return rules
  x, fm, width = cfg.num_experts, cfg.moe_mlp_dim, cfg.shared_experts * cfg.moe_mlp_dim
  rules[_ROUTED + ("gate", "kernel")] = ((e, x), _Rule((p + "mlp.gate.weight",), BF16_LINEAR))
  if cfg.routed_bias:
    rules[_ROUTED + ("gate", "bias")] = ((x,), _Rule((p + "mlp.gate.e_score_correction_bias",), F32))
  for mt, hf in projections:
    rules[_ROUTED + (mt,)] = ((x, e, fm) if mt != "wo" else (x, fm, e),
                              _Rule((p + "mlp.experts.{j}." + f"{hf}.weight",), EXPERTS_FP8))
    if width:
      rules[_MOE + ("shared_experts", mt, "kernel")] = (
          (e, width) if mt != "wo" else (width, e), _Rule((p + f"mlp.shared_experts.{hf}.weight",), FP8))
  return rules


def _stack_key(module_path: tuple[str, ...], cfg) -> tuple[str, ...]:
  """Leaf key of a layer variable: `MoEBiasVar` gate bias under nnx_aux (DeepSeek-V3 names), else params."""
  if module_path[-2:] == ("gate", "bias") and cfg.deepseek_routing:
    return tree.aux_key(module_path)
  return tree.param_key(module_path)


def _plan(cfg, mtp_shared_copies: bool) -> dict[tuple[str, ...], _Entry]:
  """Every MaxText leaf `cfg`'s model has, keyed as `params.param_leaves` keys it, with its export rule."""
  e, v, big_l, d = cfg.emb_dim, cfg.vocab_size, cfg.num_decoder_layers, cfg.first_num_dense_layers
  mtp_layers = [big_l + k - 1 for k in range(1, cfg.mtp_num_layers + 1)]
  copies = mtp_layers if mtp_shared_copies else []
  embed_names = ("model.embed_tokens.weight",) + tuple(f"model.layers.{i}.embed_tokens.weight" for i in copies)
  head_names = tuple(f"model.layers.{i}.shared_head.head.weight" for i in copies)
  if cfg.logits_via_embedding:  # tied head: HF reuses embed_tokens (tie_word_embeddings)
    embed_names += head_names
  plan = {
      tree.param_key(("token_embedder", "embedding")): _Entry((v, e), _Rule(embed_names, BF16)),
      tree.param_key(("decoder", "decoder_norm", "scale")): _Entry((e,), _Rule(("model.norm.weight",), BF16)),
  }
  if not cfg.logits_via_embedding:
    plan[tree.param_key(("decoder", "logits_dense", "kernel"))] = _Entry(
        (e, v), _Rule(("lm_head.weight",) + head_names, BF16_LINEAR))

  def add_layers(prefix: tuple[str, ...], moe: bool, hf_layers: list[int], stacked: bool) -> None:
    for sub, (shape, rule) in _layer_rules(cfg, moe).items():
      key = _stack_key(prefix + sub, cfg)
      if not stacked:
        plan[key] = _Entry(shape, rule, tuple(hf_layers))
        continue
      axis = 0 if key[:2] == tree.AUX_PREFIX else min(cfg.param_scan_axis, len(shape))
      plan[key] = _Entry(shape[:axis] + (len(hf_layers),) + shape[axis:], rule, tuple(hf_layers), axis)

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
      plan[tree.param_key(mtp + (f"mtp_{k}_{name}", "scale"))] = _Entry(
          (e,), _Rule((f"model.layers.{i}.{hf}.weight",), BF16))
    plan[tree.param_key(mtp + (f"mtp_{k}_projection", "kernel"))] = _Entry(
        (2 * e, e), _Rule((f"model.layers.{i}.eh_proj.weight",), BF16_LINEAR))
    add_layers(mtp + (f"mtp_{k}_transformer_layer",), True, [i], False)
  return plan


def source_shapes(cfg, *, mtp_shared_copies: bool = True) -> dict[tuple[str, ...], tuple[int, ...]]:
  """MaxText leaf key -> shape that `write_deepseek_fp8` needs for `cfg` (gate bias under its nnx_aux key)."""
  return {key: entry.shape for key, entry in _plan(cfg, mtp_shared_copies).items()}


# ---------------------------------------------------------------------------------------------------------
# Tensor conversion.

def _hf_matrix(kernel, rule: _Rule, cfg):
  """MaxText kernel (in axes..., out axes...) as a float32 HF Linear weight (out, in), rope in HF layout."""
  kernel = np.asarray(kernel, np.float32)
  if rule.rope and not cfg.rope_interleave:
    dr = cfg.qk_rope_head_dim
    rope = np.arange(dr).reshape(2, dr // 2).T.reshape(dr)  # HF column 2i <- i, 2i+1 <- i + dr/2
    start = kernel.shape[-1] - dr
    kernel = np.concatenate([kernel[..., :start], kernel[..., start + rope]], axis=-1)
  n_in = math.prod(kernel.shape[:rule.n_in])
  return np.ascontiguousarray(kernel.reshape(n_in, -1).T)


@functools.cache
def _jitted_block_quantize():
  import jax  # pylint: disable=import-outside-toplevel

  from quant import fp8  # pylint: disable=import-outside-toplevel

  return jax.jit(fp8.block_quantize, static_argnums=(1, 2))  # fused: ~5x faster than op-by-op on CPU


def _block_quantize(w_oi):
  """(fp8 values, float32 scale_inv) of an (out, in) weight, 128×128 blocks, as numpy arrays."""
  qvalue, scale_inv = _jitted_block_quantize()(w_oi, BLOCK, "float8_e4m3fn")
  return np.asarray(qvalue), np.asarray(scale_inv, np.float32)


def _experts(name: str, value, rule: _Rule, cfg) -> Iterator[tuple[str, Any]]:
  """One FP8 Linear per expert of (X, in, out) weights.

  Each expert is quantized on its own: quant/fp8's scales for a batch of matrices can differ by an ulp from
  those of each matrix alone (XLA computes absmax/448 through a reciprocal differently by shape), and an
  expert's bytes must not depend on its neighbours.
  """
  for j in range(value.shape[0]):
    qvalue, scale_inv = _block_quantize(_hf_matrix(value[j], rule, cfg))
    expert = name.replace("{j}", str(j))
    yield expert, qvalue
    yield expert + "_scale_inv", scale_inv


def _bf16(array):
  return np.ascontiguousarray(np.asarray(array, np.float32).astype(ml_dtypes.bfloat16))


def _convert(value, rule: _Rule, layer: int | None, cfg) -> Iterator[tuple[str, Any]]:
  """HF (name, numpy array) pairs of one layer's slice (or a top-level tensor) `value`."""
  names = [n.replace("{i}", str(layer)) for n in rule.names]
  if rule.kind == EXPERTS_FP8:
    yield from _experts(names[0], value, rule, cfg)
    return
  if rule.kind == FP8:
    qvalue, scale_inv = _block_quantize(_hf_matrix(value, rule, cfg))
    yield names[0], qvalue
    yield names[0] + "_scale_inv", scale_inv
    return
  if rule.kind == BF16_LINEAR:
    array = _bf16(_hf_matrix(value, rule, cfg))
  elif rule.kind == BF16:
    array = _bf16(value)
  else:
    array = np.ascontiguousarray(np.asarray(value, np.float32))
  for name in names:  # copies share one buffer
    yield name, array


def _synthesized(cfg) -> Iterator[tuple[str, Any]]:
  """Tensors Hugging Face needs that MaxText lacks: a zero e_score_correction_bias for DeepSeek-V3 routing
  without `routed_bias` (MaxText then adds nothing, which a zero bias reproduces)."""
  if cfg.deepseek_routing and not cfg.routed_bias:
    zeros = np.zeros((cfg.num_experts,), np.float32)
    for i in range(cfg.first_num_dense_layers, cfg.num_decoder_layers + cfg.mtp_num_layers):
      yield f"model.layers.{i}.mlp.gate.e_score_correction_bias", zeros


def _slices(value, entry: _Entry) -> Iterator[tuple[int | None, Any]]:
  """(HF layer, per-layer slice) of a leaf; indexing only, so lazy arrays read one layer at a time."""
  if entry.layer_axis is None:
    yield (entry.layers[0] if entry.layers else None), value
    return
  for s, layer in enumerate(entry.layers):
    yield layer, value[(slice(None),) * entry.layer_axis + (s,)]


# ---------------------------------------------------------------------------------------------------------
# Files.

class _ShardWriter:
  """Collects tensors and writes a safetensors shard whenever the next tensor would pass the size limit."""

  def __init__(self, dst_dir: str, max_shard_bytes: int):
    self.dst_dir, self.max_shard_bytes = dst_dir, max_shard_bytes
    self.pending: dict[str, Any] = {}
    self.pending_bytes = 0
    self.shards: list[list[str]] = []
    self.total_size = 0
    self.seen: set[str] = set()

  def add(self, name: str, array) -> None:
    if name in self.seen:
      raise AssertionError(f"tensor {name!r} produced twice")
    self.seen.add(name)
    if self.pending and self.pending_bytes + array.nbytes > self.max_shard_bytes:
      self._flush()
    self.pending[name] = array
    self.pending_bytes += array.nbytes
    self.total_size += array.nbytes

  def _path(self, k: int) -> str:
    return os.path.join(self.dst_dir, f".shard-{k:05d}.safetensors.tmp")

  def _flush(self) -> None:
    from safetensors import numpy as st_numpy  # pylint: disable=import-outside-toplevel

    path = self._path(len(self.shards) + 1)
    try:
      st_numpy.save_file(self.pending, path, metadata={"format": "pt"})
    except OSError as e:
      raise errors.InputError(f"cannot write {path!r}: {e.strerror or e}") from None
    self.shards.append(sorted(self.pending))
    self.pending, self.pending_bytes = {}, 0

  def close(self) -> dict[str, str]:
    """Writes the last shard, gives every shard its final name and returns the weight map."""
    if self.pending or not self.shards:
      self._flush()
    n = len(self.shards)
    weight_map = {}
    for k, names in enumerate(self.shards, start=1):
      final = f"model-{k:05d}-of-{n:05d}.safetensors"
      os.replace(self._path(k), os.path.join(self.dst_dir, final))
      weight_map.update({name: final for name in names})
    return dict(sorted(weight_map.items(), key=lambda item: tree.natural_key(item[0])))


def hf_config(cfg) -> dict[str, Any]:
  """`config.json` of the exported model: DeepSeek-V3 (or V2 for plain top-k routing) fields from `cfg`."""
  v3 = cfg.deepseek_routing
  groups = cfg.n_routing_groups > 0 and v3
  rope_scaling = None
  if cfg.rope_type == "yarn":
    # HF multiplies the softmax scale by mscale(factor, mscale_all_dim)^2 whenever rope_scaling is set; MaxText
    # only when max_position_embeddings > original_max_position_embeddings (mscale 0 turns it off in HF).
    extended = cfg.max_position_embeddings > cfg.original_max_position_embeddings
    mscale = cfg.mscale if extended else 0.0
    rope_scaling = {"type": "yarn", "factor": cfg.rope_factor,
                    "original_max_position_embeddings": cfg.original_max_position_embeddings,
                    "beta_fast": cfg.beta_fast, "beta_slow": cfg.beta_slow, "mscale": mscale,
                    "mscale_all_dim": mscale}
  return {
      "architectures": ["DeepseekV3ForCausalLM" if v3 else "DeepseekV2ForCausalLM"],
      "model_type": "deepseek_v3" if v3 else "deepseek_v2",
      "vocab_size": cfg.vocab_size,
      "hidden_size": cfg.emb_dim,
      "intermediate_size": cfg.mlp_dim,
      "moe_intermediate_size": cfg.moe_mlp_dim,
      "num_hidden_layers": cfg.num_decoder_layers,
      "num_nextn_predict_layers": cfg.mtp_num_layers,
      "num_attention_heads": cfg.num_query_heads,
      "num_key_value_heads": cfg.num_kv_heads,
      "n_shared_experts": cfg.shared_experts,
      "n_routed_experts": cfg.num_experts,
      "num_experts_per_tok": cfg.num_experts_per_tok,
      "routed_scaling_factor": cfg.routed_scaling_factor,
      "scoring_func": cfg.routed_score_func,
      "topk_method": "noaux_tc" if v3 else "greedy",
      "n_group": cfg.n_routing_groups if groups else 1,
      "topk_group": cfg.topk_routing_group if groups else 1,
      # MaxText renormalizes sigmoid weights (DeepSeek-V3 routing) and leaves softmax weights as they are.
      "norm_topk_prob": cfg.routed_score_func == "sigmoid",
      "first_k_dense_replace": cfg.first_num_dense_layers,
      "moe_layer_freq": 1,
      "q_lora_rank": cfg.q_lora_rank or None,
      "kv_lora_rank": cfg.kv_lora_rank,
      "qk_nope_head_dim": cfg.qk_nope_head_dim,
      "qk_rope_head_dim": cfg.qk_rope_head_dim,
      "v_head_dim": cfg.v_head_dim,
      "hidden_act": "silu",
      "max_position_embeddings": cfg.max_position_embeddings,
      "rms_norm_eps": cfg.normalization_layer_epsilon,
      "rope_theta": cfg.rope_max_timescale,
      "rope_scaling": rope_scaling,
      "rope_interleave": True,  # exported rope columns are always in HF's interleaved layout
      "attention_bias": False,
      "attention_dropout": 0.0,
      "tie_word_embeddings": cfg.logits_via_embedding,
      "torch_dtype": "bfloat16",
      "use_cache": True,
      "quantization_config": dict(QUANTIZATION_CONFIG),
  }


def _check_supported(cfg) -> None:
  """Refuses routing and rope variants that Hugging Face's DeepseekV3/V2 code would compute differently."""
  score = cfg.routed_score_func
  if cfg.deepseek_routing and score != "sigmoid":
    raise errors.ConfigError(f"routed_score_func={score!r} with DeepSeek-V3 routing cannot be exported: Hugging "
                             "Face DeepseekV3 scores experts with sigmoid; accepted: sigmoid")
  if not cfg.deepseek_routing and (cfg.routed_bias or score != "softmax"):
    raise errors.ConfigError(
        f"model_name={cfg.model_name!r} routes by plain top-k (routed_bias={str(cfg.routed_bias).lower()}, "
        f"routed_score_func={score!r}), which Hugging Face DeepseekV2 computes only with softmax scores and no "
        "bias; accepted: a deepseek3* model name (DeepSeek-V3 routing) or routed_score_func=softmax "
        "routed_bias=false")
  if cfg.rope_attention_scaling and cfg.rope_factor > 1:
    raise errors.ConfigError("rope_attention_scaling=true has no Hugging Face DeepSeek equivalent; accepted: false")


def _match(keys: list[tuple[str, ...]], plan: Mapping) -> list[tuple[tuple[str, ...], tuple[str, ...]]]:
  """Pairs each given key with its plan key (the gate bias may sit under params/params); refuses any mismatch."""
  pairs, used = [], {}
  for key in keys:
    target = key
    if key not in plan and key[:2] == tree.PARAMS_PREFIX and tree.aux_key(key[2:]) in plan:
      target = tree.aux_key(key[2:])  # converter layout keeps the MoEBiasVar gate bias under params/params
    if target not in plan:
      raise errors.MismatchError(
          f"cannot export MaxText leaf {'.'.join(key)}: no Hugging Face DeepSeek tensor corresponds to it")
    if target in used:
      raise errors.MismatchError(f"MaxText leaf {'.'.join(target[2:])} is given twice: as "
                                 f"{'.'.join(used[target])} and {'.'.join(key)}")
    used[target] = key
    pairs.append((key, target))
  missing = [".".join(k) for k in plan if k not in used]
  if missing:
    more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
    raise errors.MismatchError(f"cannot export: MaxText leaf {missing[0]} is missing{more}")
  return sorted(pairs, key=lambda pair: tree.natural_key(".".join(pair[0])))


def write_deepseek_fp8(arrays: Mapping[tuple[str, ...], Any], cfg, dst_dir: str, *,
                       max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, mtp_shared_copies: bool = True,
                       progress: Callable[[int, int, str], None] | None = None) -> dict[str, Any]:
  """Writes `arrays` (MaxText leaf key -> float array) as an FP8 Hugging Face DeepSeek checkpoint in `dst_dir`.

  Args:
    arrays: every leaf of `cfg`'s model, keyed as `params.param_leaves(..., include_non_params=True)` keys it
      (the DeepSeek-V3 gate bias under nnx_aux/model or params/params). It may be lazy: each key is fetched
      once, then indexed one layer (and expert) at a time, so array-likes that read on indexing stay small.
    cfg: the `ModelConfig` the arrays belong to.
    dst_dir: an existing empty directory.
    max_shard_bytes: a shard is closed before a tensor would take it past this size.
    mtp_shared_copies: also write the MTP layers' copies of embed_tokens and shared_head.head, as the release.
    progress: called as `progress(done, total, dotted_key)` before each leaf.

  Returns:
    {"files": shard names, "num_tensors", "num_fp8", "total_size" (bytes of tensor data), "config": config.json}.

  Raises:
    errors.ConfigError: a model feature with no Hugging Face DeepSeek equivalent.
    errors.MismatchError: a leaf that maps to nothing, a missing leaf, or a leaf of the wrong shape.
  """
  _check_supported(cfg)
  plan = _plan(cfg, mtp_shared_copies)
  pairs = _match(list(arrays.keys()), plan)
  writer = _ShardWriter(dst_dir, max_shard_bytes)
  num_fp8 = 0
  for done, (key, target) in enumerate(pairs):
    if progress is not None:
      progress(done, len(pairs), ".".join(key))
    value, entry = arrays[key], plan[target]
    if tuple(value.shape) != entry.shape:
      raise errors.MismatchError(f"MaxText leaf {'.'.join(key)} has shape {tuple(value.shape)}; "
                                 f"the model of this config has {entry.shape}")
    for layer, part in _slices(value, entry):
      for name, array in _convert(part, entry.rule, layer, cfg):
        num_fp8 += name.endswith("_scale_inv")
        writer.add(name, array)
  for name, array in _synthesized(cfg):
    writer.add(name, array)
  weight_map = writer.close()
  config = hf_config(cfg)
  index = {"metadata": {"total_size": writer.total_size, "producer": "inspect_checkpoint"}, "weight_map": weight_map}
  for name, doc in ((INDEX_NAME, index), ("config.json", config)):
    path = os.path.join(dst_dir, name)
    try:
      with open(path, "w", encoding="utf-8") as f:
        f.write(json.dumps(doc, indent=2) + "\n")
    except OSError as e:
      raise errors.InputError(f"cannot write {path!r}: {e.strerror or e}") from None
  files = sorted(set(weight_map.values()))
  return {"files": files, "num_tensors": len(weight_map), "num_fp8": num_fp8, "total_size": writer.total_size,
          "config": config}
