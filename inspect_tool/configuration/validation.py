"""MaxText's validation rules for a model config: each refusal names the value and what is accepted."""

from __future__ import annotations

from inspect_tool import errors
from inspect_tool.configuration import limits
from quant import calibration as calibration_lib
from quant import errors as quant_errors
from quant import settings

QUANTIZATION_MODES = settings.QUANTIZATION_MODES
DTYPES = ("float32", "bfloat16", "float16")
SCORE_FUNCS = ("sigmoid", "softmax", "sqrtsoftplus")  # sqrtsoftplus: DeepSeek-V4


def _check(ok: bool, message: str) -> None:
  if not ok:
    raise errors.ConfigError(message)


def validate(c) -> None:
  """MaxText's rules that matter here; each message names the value and what is accepted."""
  limits.check_config_numbers(c)  # finite numbers within int64 first (inspect_tool/configuration/limits.py)
  _check(c.enable_nnx, "enable_nnx=false is not supported: this tool builds Flax NNX models only "
         "(the parameter tree is the same as MaxText's Linen checkpoint layout); use enable_nnx=true")
  _check(c.decoder_block in ("deepseek", "deepseek4"),
         f"decoder_block={errors.shown(c.decoder_block)} is not supported; accepted: 'deepseek', 'deepseek4'")
  expected_attention = "compressed" if c.decoder_block == "deepseek4" else "mla"
  _check(c.attention_type == expected_attention,
         f"attention_type={errors.shown(c.attention_type)} is not supported with "
         f"decoder_block={errors.shown(c.decoder_block)}; accepted: {expected_attention!r}")
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
  if c.decoder_block == "deepseek4":  # after the sizes: its checks use them
    _validate_deepseek4(c)
  _check(c.qk_rope_head_dim % 2 == 0, f"qk_rope_head_dim={c.qk_rope_head_dim} must be even")
  _check(c.first_num_dense_layers <= c.num_decoder_layers,
         f"first_num_dense_layers={c.first_num_dense_layers} exceeds the {c.num_decoder_layers} decoder layers "
         f"({_layers(c)})")
  _check(c.num_experts == 1 or c.first_num_dense_layers > 0 or c.base_mlp_dim == c.base_moe_mlp_dim,
         f"a fully MoE model (first_num_dense_layers=0) needs base_mlp_dim == base_moe_mlp_dim "
         f"(got {c.base_mlp_dim} and {c.base_moe_mlp_dim})")
  _check(c.num_experts_per_tok <= c.num_experts,
         f"num_experts_per_tok={c.num_experts_per_tok} exceeds num_experts={c.num_experts}")
  _check(c.param_scan_axis in (0, 1), f"param_scan_axis={c.param_scan_axis}; accepted: 0, 1")
  _check(c.routed_score_func in SCORE_FUNCS + ("",),
         f"routed_score_func={errors.shown(c.routed_score_func)}; accepted: {', '.join(SCORE_FUNCS)}")
  _check(c.dtype in DTYPES, f"dtype={errors.shown(c.dtype)}; accepted: {', '.join(DTYPES)}")
  _check(c.weight_dtype in DTYPES, f"weight_dtype={errors.shown(c.weight_dtype)}; accepted: {', '.join(DTYPES)}")
  mu_dtype = c.mu_dtype
  _check(mu_dtype in ("",) + DTYPES, f"mu_dtype={errors.shown(mu_dtype)}; accepted: '' (the weight dtype), "
         f"{', '.join(DTYPES)}")
  _check(tuple(c.mlp_activations) in (("silu", "linear"),),
         f"mlp_activations={list(c.mlp_activations)}; accepted: ['silu', 'linear']")
  _check(c.n_routing_groups == -1 or (c.n_routing_groups > 0 and c.num_experts % c.n_routing_groups == 0
                                      and 0 < c.topk_routing_group <= c.n_routing_groups),
         f"n_routing_groups={c.n_routing_groups} topk_routing_group={c.topk_routing_group}: groups must divide "
         f"num_experts={c.num_experts} and 0 < topk_routing_group <= n_routing_groups (or both -1)")
  _check(c.quantization in QUANTIZATION_MODES,
         f"quantization={errors.shown(c.quantization)}; accepted: {', '.join(repr(q) for q in QUANTIZATION_MODES)}")
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
           f"quantize_mtp=true needs quantization=fp8_full (got quantization={errors.shown(c.quantization)})")
  if c.quantize_logits_proj:
    _check(c.quantization == "fp8_full",
           f"quantize_logits_proj=true needs quantization=fp8_full (got quantization={errors.shown(c.quantization)})")
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
  _validate_positive_floats(c)
  _check(c.mhc_expansion_rate >= 1, f"mhc_expansion_rate={c.mhc_expansion_rate} must be >= 1")
  _check(not c.engram_layers, f"engram_layers={list(c.engram_layers)} is not supported: Engram layers are sized from "
         "a Hugging Face tokenizer (MaxText needs tokenizer_path and hf_access_token); accepted: "
         "override_model_config=true engram_layers=[]")
  _check(c.mtp_eval_target_module <= c.mtp_num_layers,
         f"mtp_eval_target_module={c.mtp_eval_target_module} exceeds mtp_num_layers={c.mtp_num_layers}")
  limits.check_config(c)  # buildable sizes (inspect_tool/configuration/limits.py)


# Numbers the forward pass divides by or takes the log of (RoPE, YaRN, RMSNorm): zero or negative values give
# `math domain error` tracebacks or NaN logits, so they must be positive.
POSITIVE_NUMBERS = ("normalization_layer_epsilon", "rope_max_timescale", "max_position_embeddings",
                    "original_max_position_embeddings", "rope_factor", "beta_fast", "beta_slow")


def _validate_positive_floats(c) -> None:
  for name in POSITIVE_NUMBERS:
    value = getattr(c, name)
    _check(value > 0, f"{name}={value} must be > 0 (RoPE, YaRN and RMSNorm divide by it or take its log)")
  recall = c.indexer_approx_top_k_recall
  _check(0 < recall <= 1, f"indexer_approx_top_k_recall={recall} must be in (0, 1] (a recall target)")


def forward_failure(c) -> str | None:
  """Why MaxText 0.2.5 builds this model but cannot run it (None: it runs).

  With mHC (`mhc_expansion_rate` > 1) and MTP, MaxText builds and lists the MTP layer (mHC included), but its
  forward pass hands that layer the reduced hidden state [batch, seq, emb] while the layer's mHC expects the
  expanded streams [batch, seq, k, emb] (MaxText's `mhc.py`: `b, s, k, d = x.shape` raises; its Qwix pass,
  a forward pass too, fails the same way).
  """
  if c.mhc_expansion_rate > 1 and c.mtp_num_layers > 0:
    return (f"mtp_num_layers={c.mtp_num_layers} with mhc_expansion_rate={c.mhc_expansion_rate}: MaxText 0.2.5 builds "
            "this model but its forward pass fails in the MTP layer's mHC (ValueError: not enough values to unpack "
            "(expected 4, got 3)): the MTP layer receives the reduced hidden state while mHC expects the expanded "
            "streams")
  return None


def check_runs(c, command: str) -> None:
  """Refuses (exit 2, one line) to run a model MaxText builds but cannot run (`forward_failure`)."""
  reason = forward_failure(c)
  _check(reason is None, f"{command}: {reason}; accepted: mtp_num_layers=0 (the listing, --summary, --devices and "
         "rules show the model as MaxText builds it)")


def _layers(c) -> str:
  """The keys that give the decoder layer count, as the user set them."""
  if c.global_parameter_scale == 1:
    return f"base_num_decoder_layers={c.base_num_decoder_layers}"
  return f"base_num_decoder_layers={c.base_num_decoder_layers} at global_parameter_scale={c.global_parameter_scale}"


def _validate_deepseek4(c) -> None:
  """DeepSeek-V4: MaxText's own rules plus what its model needs to build."""
  _check(c.mtp_num_layers == 0, f"mtp_num_layers={c.mtp_num_layers}: DeepSeek4 decoder block currently does not "
         "support MTP layers (MaxText 0.2.5); accepted: mtp_num_layers=0")
  _check(c.mhc_expansion_rate > 1, f"mhc_expansion_rate={c.mhc_expansion_rate}: MaxText's DeepSeek-V4 layer always "
         "applies mHC; accepted: mhc_expansion_rate >= 2")
  ratios = []
  for value in c.compress_ratios:
    _check(str(value).isdigit() and (int(value) == 0 or int(value) >= 4),
           f"compress_ratios entry {errors.shown(value)}: compress_ratio must be 0 (disabled) or >= 4")
    ratios.append(int(value))
  layers = _layers(c)
  _check(0 <= c.first_num_hash_layers <= c.num_decoder_layers,
         f"first_num_hash_layers={c.first_num_hash_layers} must be within 0..{c.num_decoder_layers} (the decoder "
         f"layers, {layers})")
  needed, by = (c.num_decoder_layers, layers)
  if c.scan_layers:
    needed, by = c.first_num_hash_layers, f"first_num_hash_layers={c.first_num_hash_layers} with scan_layers=true"
  _check(len(ratios) >= needed, f"compress_ratios has {len(ratios)} entries; {by} needs {needed}, one per layer")
  _check(c.sliding_window_size >= 0, f"sliding_window_size={c.sliding_window_size} must be >= 0 (0: every "
         "uncompressed key; n: the last n)")
  _check(c.compressed_rope_max_timescale > 0,
         f"compressed_rope_max_timescale={c.compressed_rope_max_timescale} must be a positive integer")
  _check(c.num_kv_heads == 1, f"base_num_kv_heads={c.base_num_kv_heads}: compressed attention has one key/value "
         "head (the compressed blocks are one head); accepted: 1")
  for name in ("q_lora_rank", "o_groups", "o_lora_rank"):
    _check(getattr(c, name) > 0, f"{name}={getattr(c, name)} must be a positive integer with decoder_block=deepseek4")
  _check(c.num_query_heads * c.head_dim % c.o_groups == 0,
         f"o_groups={c.o_groups} must divide num_query_heads*head_dim={c.num_query_heads * c.head_dim}")
  _check(0 < c.qk_rope_head_dim <= c.head_dim and c.qk_rope_head_dim % 2 == 0,
         f"qk_rope_head_dim={c.qk_rope_head_dim} must be even and within 1..head_dim={c.head_dim}")


def _validate_calibrations(c) -> None:
  """The calibration methods the quantized run accepts (symmetric: absmax, rms,<f>, fixed,<hi>), checked up front."""
  for name in ("weight_quantization_calibration_method", "act_quantization_calibration_method",
               "bwd_quantization_calibration_method", "logits_proj_quant_calibration_method",
               "drhs_grad_quantization_calibration_method"):
    value = getattr(c, name)
    if not value:
      continue
    try:
      calibration_lib.parse_calibration(value)
    except quant_errors.QuantError:
      raise errors.ConfigError(
          f"{name}={errors.shown(value)} is not supported with quantization={c.quantization!r}: the run quantizes "
          f"symmetrically; accepted: {', '.join(calibration_lib.CALIBRATIONS)}") from None
