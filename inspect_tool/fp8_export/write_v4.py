"""Export stage 4, `--layout deepseek-v4`: DeepSeek-V4's release layout, what its servers (vLLM, SGLang: keyed on
`expert_dtype`) and transformers 5.24 (`DeepseekV4ForCausalLM`) load.

`write_deepseek_v4(arrays, cfg, dst_dir)` maps every MaxText `deepseek4` leaf to its release tensor(s)
(`hf.names_v4`, MaxText 0.2.5's V4 mapping, which the reader uses too) and writes:
* FP4 routed experts (`expert_dtype: fp4`): each expert's (out, in) weight as int8 bytes of two e2m1 values (low
  nibble first) with one float8_e8m0fnu scale per 32 values of a row (`<x>.scale`), `quant.microscaling`;
* FP8: every other Linear the release quantizes (wq_a, wq_b, wkv, wo_a, wo_b, the indexer's wq_b, the shared
  experts) as float8_e4m3fn with one float8_e8m0fnu scale per 128×128 block (powers of two: `scale_fmt: ue8m0`);
* bf16: embedding, head, norms, the router and the compressors' and indexer's other projections, as the release;
  float32: mHC (`hc_*_fn`, `_base`, `_scale`; MaxText's `mhc_norm` scale folded into the alphas: the release's mHC
  norm has no weight, so a scale of ones writes the alphas exactly), `hc_head_*`, `attn_sink`, `ape`, the gate
  bias (zeros where MaxText has none: transformers' router always adds one); `tid2eid` as int32;
* `config.json` in the release's spelling (`compress_ratios`, `num_hash_layers`, `compress_rope_theta`,
  `expert_dtype: fp4`, `quantization_config` with `scale_fmt: ue8m0` and 128×128 blocks), shards and the index.

Refused (one line): a model the release's readers cannot express: compress ratios other than 0, 4 and 128 (the
values `compress_ratios` maps to layer types), `mlp_activations_limit` <= 0 (its `swiglu_limit` clamps always), a
non-DeepSeek-V4 decoder. Memory is bounded as `write_hf`'s: matrices by `hf_matrices`, rows by `hf_rows`.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from inspect_tool import errors
from inspect_tool.hf import names as hf_names
from inspect_tool.hf import names_v4 as hf_names_v4
from inspect_tool.hf.names import EXPERTS_FP8
from inspect_tool.fp8_export import hf_matrices
from inspect_tool.fp8_export import hf_rows
from inspect_tool.fp8_export import write_hf
from inspect_tool.streaming import budget
from inspect_tool.streaming import safetensors_writer
from inspect_tool.streaming import source as source_lib

FP8_CODEC = hf_matrices.Codec("fp8", power_of_two=True, e8m0=True, v4_names=True)
FP4_CODEC = hf_matrices.Codec("fp4", v4_names=True)
QUANTIZATION_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "scale_fmt": "ue8m0",
                       "weight_block_size": list(hf_names.BLOCK)}
RELEASE_RATIOS = (0, 4, 128)
_ROWS = (hf_names.BF16, hf_names.BF16_LINEAR, hf_names.F32, hf_names.F32_LINEAR)


def check_supported(cfg) -> None:
  """Refuses what DeepSeek-V4's release layout cannot express, in one line."""
  if cfg.decoder_block != "deepseek4":
    raise errors.ConfigError(f"--layout deepseek-v4 writes DeepSeek-V4 models; model {cfg.model_name!r} has "
                             f"decoder_block={cfg.decoder_block}; accepted: a deepseek4 model (--layout deepseek-fp8 "
                             "for DeepSeek-V2/V3)")
  ratios = [int(r) for r in cfg.compress_ratios[:cfg.num_decoder_layers]]
  odd = sorted({r for r in ratios if r not in RELEASE_RATIOS})
  if odd:
    raise errors.ConfigError(f"compress_ratios holds {odd[0]}: DeepSeek-V4's config.json maps only "
                             f"{', '.join(map(str, RELEASE_RATIOS))} to layer types; accepted: those ratios")
  if cfg.mlp_activations_limit <= 0:
    raise errors.ConfigError(f"mlp_activations_limit={cfg.mlp_activations_limit:g}: DeepSeek-V4's swiglu_limit always "
                             "clamps the expert activations; accepted: a positive limit")


def hf_config(cfg) -> dict[str, Any]:
  """`config.json` in DeepSeek-V4's release spelling (what vLLM, SGLang and transformers read)."""
  return {
      "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
      "vocab_size": cfg.vocab_size, "hidden_size": cfg.emb_dim, "moe_intermediate_size": cfg.moe_mlp_dim,
      "num_hidden_layers": cfg.num_decoder_layers, "num_attention_heads": cfg.num_query_heads,
      "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "qk_rope_head_dim": cfg.qk_rope_head_dim,
      "q_lora_rank": cfg.q_lora_rank, "o_groups": cfg.o_groups, "o_lora_rank": cfg.o_lora_rank,
      "n_routed_experts": cfg.num_experts, "num_experts_per_tok": cfg.num_experts_per_tok,
      "n_shared_experts": cfg.shared_experts, "scoring_func": cfg.routed_score_func, "topk_method": "noaux_tc",
      "norm_topk_prob": True, "routed_scaling_factor": cfg.routed_scaling_factor,
      "swiglu_limit": cfg.mlp_activations_limit, "hidden_act": "silu", "sliding_window": cfg.sliding_window_size,
      "compress_ratios": [int(r) for r in cfg.compress_ratios[:cfg.num_decoder_layers]],
      "compress_rope_theta": cfg.compressed_rope_max_timescale, "rope_theta": cfg.rope_max_timescale,
      "num_hash_layers": cfg.first_num_hash_layers, "hc_mult": cfg.mhc_expansion_rate,
      "hc_sinkhorn_iters": int(cfg.sinkhorn_iterations), "hc_eps": 1e-6,
      "index_n_heads": cfg.indexer_n_heads, "index_head_dim": cfg.indexer_head_dim, "index_topk": cfg.indexer_topk,
      "rms_norm_eps": cfg.normalization_layer_epsilon, "max_position_embeddings": cfg.max_position_embeddings,
      "tie_word_embeddings": cfg.logits_via_embedding, "attention_bias": False, "num_nextn_predict_layers": 0,
      "torch_dtype": "bfloat16", "expert_dtype": "fp4", "quantization_config": dict(QUANTIZATION_CONFIG),
  }


def _layer(value, entry: hf_names.Entry, s: int) -> np.ndarray:
  """One layer's slice of a leaf (float32), read by indexing only (lazy arrays read just that layer)."""
  if entry.layer_axis is None:
    return np.asarray(value, np.float32)
  return np.asarray(value[(slice(None),) * entry.layer_axis + (s,)], np.float32)


def _write_mhc(writer, module: dict[str, tuple], cfg) -> None:
  """One mHC module's three release tensors per layer from its ten MaxText leaves (`hf_names_v4.MHC_KINDS`): the
  alphas times the norm scale (MaxText applies it to the norm's output, the release has none) as `hc_*_fn`."""
  norm_value, norm_entry = module["mhc_norm"]
  any_entry = module["pre_alpha"][1]
  layers = any_entry.layers if any_entry.layer_axis is not None else any_entry.layers[:1]
  for s, layer in enumerate(layers):
    scale = _layer(norm_value, norm_entry, s)[:, None]
    for kind, suffix in ((hf_names_v4.MHC_FN, "alpha"), (hf_names_v4.MHC_BASE, "beta"),
                         (hf_names_v4.MHC_SCALE, "alpha_scale")):
      parts = []
      for part in ("pre", "post", "res"):
        value, entry = module[f"{part}_{suffix}"]
        parts.append(_layer(value, entry, s) * (scale if kind == hf_names_v4.MHC_FN else 1.0))
      name = module[f"pre_{suffix}"][1].rule.names[0].replace("{i}", str(layer))
      writer.add(name, hf_names_v4.mhc_tensor(parts, kind).astype(np.float32))


def _write_table(writer, value, entry: hf_names.Entry, cfg) -> None:
  """The hash layer's token -> experts table as int32 (MaxText keeps it in float32): integers below num_experts."""
  table = _layer(value, entry, 0)
  ids = np.rint(table)
  if not (np.array_equal(ids, table) and (ids >= 0).all() and (ids < cfg.num_experts).all()):
    raise errors.MismatchError(f"{entry.rule.names[0].replace('{i}', str(entry.layers[0]))}: MaxText's tid2eid holds "
                               f"values that are not expert ids 0..{cfg.num_experts - 1}")
  writer.add(entry.rule.names[0].replace("{i}", str(entry.layers[0])), ids.astype(np.int32))


def _zero_biases(cfg) -> list[str]:
  """Gate biases the release needs where MaxText has none (routed_bias=false): zeros, which add nothing."""
  if cfg.routed_bias:
    return []
  return [f"layers.{i}.ffn.gate.bias" for i in range(cfg.first_num_hash_layers, cfg.num_decoder_layers)]


def write_deepseek_v4(arrays: Mapping[tuple[str, ...], Any], cfg, dst_dir: str, *,
                      max_shard_bytes: int = write_hf.DEFAULT_MAX_SHARD_BYTES,
                      work_bytes: int = write_hf.DEFAULT_WORK_BYTES,
                      header_reserve: int = safetensors_writer.DEFAULT_HEADER_RESERVE,
                      chunk_shape: Callable[[tuple[str, ...]], Sequence[int] | None] | None = None,
                      read_overhead: Callable[[tuple[str, ...], Sequence[int]], int] | None = None,
                      progress: Callable[[int, int, str], None] | None = None, tally=None,
                      digests=None) -> dict[str, Any]:
  """Writes `arrays` (every leaf of `cfg`'s deepseek4 model, MaxText key -> float array, lazy ones indexed by
  layers, experts and rows) in DeepSeek-V4's release layout in `dst_dir` (an existing empty directory).

  Returns `write_hf.HfWritten` as `write_hf.write_deepseek_fp8` does, with `num_fp4` (FP4 expert matrices) beside
  `num_fp8`; `tally` and `digests` as it takes them.
  """
  check_supported(cfg)
  plan = hf_names_v4.leaf_plan(cfg)
  pairs = write_hf._match(list(arrays.keys()), plan)  # pylint: disable=protected-access
  mhc: dict[tuple[str, ...], dict[str, tuple]] = {}
  with safetensors_writer.ShardedWriter(dst_dir, max_shard_bytes, header_reserve=header_reserve,
                                       digests=digests) as writer:
    for done, (key, target) in enumerate(pairs):
      if progress is not None:
        progress(done, len(pairs), ".".join(key))
      value, entry = source_lib.as_view(arrays[key]), plan[target]
      if tuple(value.shape) != entry.shape:
        raise errors.MismatchError(f"MaxText leaf {'.'.join(key)} has shape {tuple(value.shape)}; "
                                   f"the model of this config has {entry.shape}")
      writer.origin = (key, tuple(value.shape), np.dtype(value.dtype).name)
      kind = entry.rule.kind
      if kind in hf_names_v4.MHC_KINDS or kind == hf_names_v4.ONES:
        name = target[-2] if target[-1] == "scale" and target[-2] == "mhc_norm" else target[-1]
        module = target[:-2] if name == "mhc_norm" else target[:-1]
        mhc.setdefault(module, {})[name] = (value, entry)
        if len(mhc[module]) == 10:
          _write_mhc(writer, mhc.pop(module), cfg)
        continue
      if kind == hf_names_v4.TABLE:
        _write_table(writer, value, entry, cfg)
        continue
      chunk = chunk_shape(key) if chunk_shape else None
      overhead = functools.partial(read_overhead, key) if read_overhead else (lambda box: 0)
      if kind in hf_matrices.MATRIX_KINDS:
        codec = FP4_CODEC if kind == EXPERTS_FP8 else FP8_CODEC
        spare = work_bytes - budget.SLICE_FACTOR * hf_matrices.unit_bytes(entry)
        hf_matrices.write_leaf(writer, value, entry, cfg, spare, chunk, codec, overhead, tally)
        continue
      if kind not in _ROWS:
        raise errors.MismatchError(f"MaxText leaf {'.'.join(key)}: no DeepSeek-V4 writer for its kind {kind}")
      stream = value.stream_overhead or 0
      row_bytes = max(1, min(write_hf.MAX_ROW_BLOCK_BYTES, (work_bytes - stream) // (budget.SLICE_FACTOR + 2)))
      hf_rows.write_leaf(writer, value, entry, cfg, row_bytes, chunk,
                         work_bytes - budget.SLICE_FACTOR * max(row_bytes, hf_matrices.unit_bytes(entry)), overhead)
    writer.origin = None
    if mhc:
      raise errors.MismatchError(f"MaxText's mHC module {'.'.join(next(iter(mhc)))} is incomplete")
    for name in _zero_biases(cfg):
      writer.add(name, np.zeros((cfg.num_experts,), np.float32))
    weight_map = writer.close()
  config = hf_config(cfg)
  write_hf.write_index_and_config(dst_dir, weight_map, writer.total_size, config)
  experts = {name for name in weight_map if ".ffn.experts." in name and name.endswith(".scale")}
  scales = {name for name in weight_map if name.endswith(".scale")}
  return write_hf.HfWritten(sorted(set(weight_map.values())), len(weight_map), len(scales - experts),
                            writer.total_size, config, writer.origins, weight_map, num_fp4=len(experts))
