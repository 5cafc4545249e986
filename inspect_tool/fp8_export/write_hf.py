"""Export stage 4, `--layout deepseek-fp8` / `deepseek-bf16`: Hugging Face DeepSeek safetensors in DeepSeek-V3's
release layout, FP8 (the release's own) or bfloat16 (`fp8=False`: the same names, every weight bf16, no scales).

`write_deepseek_fp8(arrays, cfg, dst_dir)` maps every MaxText leaf to its Hugging Face DeepSeek-V3 (or V2)
tensor(s), quantizes the Linear weights to float8_e4m3fn with one float32 `weight_scale_inv` per 128×128 block
(`dequantized = fp8 * weight_scale_inv`, blocks of the (out, in) matrix, edge blocks smaller), and writes
`model-0000k-of-0000n.safetensors` shards, `model.safetensors.index.json` and `config.json` (with DeepSeek's
`quantization_config`). DeepSeek-V3 routing (deepseek3* names, sigmoid) exports as `DeepseekV3ForCausalLM`,
plain softmax top-k without bias (deepseek2*) as `DeepseekV2ForCausalLM`; other routings are refused.

Names (MTP depth k as layer `L + k - 1`, the MTP layers' copies of embedding and head, rope columns in HF's
interleaved layout) come from `inspect_tool.hf.names`, which the reader (`hf_restore`) uses too.

Choices (they follow DeepSeek-V3's official FP8 checkpoint):
* FP8 + `_scale_inv`: every attention projection, dense MLP, shared-expert and routed-expert weight, MTP
  transformer layers included.
* bfloat16: embeddings, `lm_head`, all RMSNorm weights, the router `mlp.gate.weight` and the MTP `eh_proj`
  (the release keeps eh_proj unquantized: serving stacks load it as a plain Linear). `e_score_correction_bias`
  stays float32 as in the release (bf16 rounding of the bias could change which experts are picked).
* The MTP layers' copies of embed_tokens and shared_head.head are written (`mtp_shared_copies=False` leaves them
  out), as serving loaders read them.

Memory holds the units of work under way (FP8 matrices, converted by `hf_matrices`, two at once where the budget
holds them; or a block of rows of an embedding, head or norm, `hf_rows`), and each tensor is written to its shard
as soon as it is converted (`safetensors_writer`): `plan_memory` checks a `--max-memory` and sizes the row blocks.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np

from inspect_tool import errors
from inspect_tool.hf import names as hf_names
from inspect_tool.hf import names_v4 as hf_names_v4
from inspect_tool.hf.names import BLOCK, EXPERTS_FP8, FP8
from inspect_tool.fp8_export import hf_matrices
from inspect_tool.fp8_export import hf_rows
from inspect_tool.output import atomic
from inspect_tool.paramtree import tree
from inspect_tool.streaming import budget
from inspect_tool.streaming import read_plan
from inspect_tool.streaming import safetensors_writer
from inspect_tool.streaming import source as source_lib

DEFAULT_MAX_SHARD_BYTES = 5 * 10**9
DEFAULT_WORK_BYTES = 2 * 2**30  # memory for the work of `write_deepseek_fp8` when no --max-memory sizes it
MAX_ROW_BLOCK_BYTES = 64 * 2**20  # float32 bytes of the rows of an embedding, head or norm converted at once
# Beside export's reserves (`budget.reserve_bytes`): a source of 256 KiB chunks peaked 19 MB over the floor then
# named (+16 MiB) in a whole test suite's run (tests/test_export_chunks_memory.py), 48 MB more than alone.
RESERVE_BYTES = 32 * 2**20
INDEX_NAME = "model.safetensors.index.json"
QUANTIZATION_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                       "weight_block_size": list(BLOCK)}


def source_shapes(cfg, *, mtp_shared_copies: bool = True) -> dict[tuple[str, ...], tuple[int, ...]]:
  """MaxText leaf key -> shape that `write_deepseek_fp8` needs for `cfg` (gate bias under its nnx_aux key)."""
  return {key: entry.shape for key, entry in hf_names.leaf_plan(cfg, mtp_shared_copies).items()}


# ---------------------------------------------------------------------------------------------------------
# Tensor conversion.

def _synthesized(cfg) -> Iterator[tuple[str, Any]]:
  """The zero e_score_correction_bias tensors of `hf_names.synthesized_names`."""
  names = hf_names.synthesized_names(cfg)
  zeros = np.zeros((cfg.num_experts,), np.float32)
  for name in names:
    yield name, zeros


def plan_memory(keys, cfg, max_memory: int, *, held: int,
                chunk_shape: Callable[[tuple[str, ...]], Sequence[int] | None] | None = None,
                read_overhead: Callable[[tuple[str, ...], Sequence[int]], int] | None = None,
                mtp_shared_copies: bool = True,
                cached_overhead: Callable[[tuple[str, ...], Sequence[int]], int] | None = None,
                stream_overhead: Callable[[tuple[str, ...]], int | None] | None = None, v4: bool = False) -> int:
  """The memory `write_deepseek_fp8(work_bytes=...)` may use for its work under `max_memory`.

  A leaf needs at least its smallest read (one source chunk along the axes it is read along, whole elsewhere,
  float32) with what decoding it holds (`read_overhead(key, block)`, or `cached_overhead(key, block)` when it is
  read through a chunk cache: the stored bytes of the chunks being decoded; or its smallest streamed box with what a
  stream holds, `stream_overhead(key)`, for an array stored as one chunk) and `budget.SLICE_FACTOR` times its unit of
  work (one routed expert's matrix, one FP8 matrix of a layer: they are quantized whole; one row of an embedding,
  head or norm), beside `held` (what the process holds). At DeepSeek-V3's size the largest unit is a dense-layer
  MLP matrix, 18432 x 7168 float32 (528 MB).

  Raises:
    errors.InputError: `max_memory` is smaller than what the largest leaf needs; the line names the smallest
      budget that works.
  """
  plan = hf_names_v4.leaf_plan(cfg) if v4 else hf_names.leaf_plan(cfg, mtp_shared_copies)
  worst = (0, None, None, 0)
  for key, target in _match(list(keys), plan):
    entry = plan[target]
    chunk = chunk_shape(key) if chunk_shape else None
    box = read_plan.minimal_box(entry.shape, chunk, hf_matrices.read_axes(entry))
    decoding = int(read_overhead(key, box)) if read_overhead else 0
    if cached_overhead is not None and chunk:  # read through a chunk cache: its stored bytes, not the box besides
      decoding = min(decoding, int(cached_overhead(key, box)))
    what = f"decoded source chunks of {budget.format_size(decoding)}" if decoding else ""
    stream = stream_overhead(key) if stream_overhead is not None else None
    streamed = read_plan.streamed_box(entry.shape, hf_matrices.read_axes(entry))
    if stream is not None and 4 * math.prod(streamed) + stream < 4 * math.prod(box) + decoding:
      box, decoding = streamed, stream
      what = f"a stream of its one stored chunk, {budget.format_size(stream)}"
    need = held + 4 * math.prod(box) + decoding + budget.SLICE_FACTOR * hf_matrices.unit_bytes(entry)
    if need > worst[0]:
      worst = (need, key, entry.shape, what)
  need, key, shape, what = worst
  if need > max_memory:
    raise errors.InputError(
        f"--max-memory {budget.format_size(max_memory)} is smaller than the smallest slice of {'/'.join(key)} "
        f"{shape} needs (with the {budget.format_size(held)} the process holds{' and ' + what if what else ''}); "
        f"accepted: at least {budget.format_size(need)}")
  return int(max_memory - held)


def _rope_scaling(cfg) -> dict[str, Any]:
  """`rope_scaling` that Hugging Face's YaRN reader turns into the rotary embedding and softmax scale MaxText runs.

  MaxText uses YaRN's frequencies always, multiplies the rotated q/k by 0.1 ln(factor) + 1 only with
  `rope_attention_scaling` (and factor > 1), and the softmax scale by (0.1 mscale ln(factor) + 1)^2 only when
  max_position_embeddings > original_max_position_embeddings. HF multiplies cos/sin by `attention_factor` (when
  it is absent: mscale(factor, mscale) / mscale(factor, mscale_all_dim) if both are non-zero, else 0.1 ln(factor)
  + 1) and the softmax scale by mscale(factor, mscale_all_dim)^2 when mscale_all_dim is non-zero. So the factor
  is written explicitly, and mscale = mscale_all_dim is MaxText's mscale when it extends the context, else 0
  (readers that ignore attention_factor, such as DeepSeek's own code, then compute a ratio of 1).
  """
  extended = cfg.max_position_embeddings > cfg.original_max_position_embeddings
  mscale = cfg.mscale if extended else 0.0
  scaled = cfg.rope_attention_scaling and cfg.rope_factor > 1
  return {"type": "yarn", "rope_type": "yarn", "factor": cfg.rope_factor,
          "original_max_position_embeddings": cfg.original_max_position_embeddings,
          "beta_fast": cfg.beta_fast, "beta_slow": cfg.beta_slow, "mscale": mscale, "mscale_all_dim": mscale,
          "attention_factor": 0.1 * math.log(cfg.rope_factor) + 1.0 if scaled else 1.0,
          "truncate": bool(cfg.rope_truncate)}


def hf_config(cfg, fp8: bool = True, scale_fmt: str | None = None) -> dict[str, Any]:
  """`config.json` of the exported model: DeepSeek-V3 (or V2 for plain top-k routing) fields from `cfg`; the FP8
  layout's `quantization_config` with `fp8` (and `scale_fmt: ue8m0`, V3.1's, with that `scale_fmt`)."""
  v3 = cfg.deepseek_routing
  groups = cfg.n_routing_groups > 0 and v3
  rope_scaling = None
  if cfg.rope_type == "yarn":
    rope_scaling = _rope_scaling(cfg)
  indexer = {"index_n_heads": cfg.indexer_n_heads, "index_head_dim": cfg.indexer_head_dim,
             "index_topk": cfg.indexer_topk} if cfg.use_indexer else {}  # DeepSeek-V3.2's release fields
  architecture, model_type = (("DeepseekV32ForCausalLM", "deepseek_v32") if cfg.use_indexer else
                              ("DeepseekV3ForCausalLM", "deepseek_v3") if v3 else
                              ("DeepseekV2ForCausalLM", "deepseek_v2"))
  doc = indexer | {
      "architectures": [architecture],
      "model_type": model_type,
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
  }
  quantization = dict(QUANTIZATION_CONFIG) | ({"scale_fmt": scale_fmt} if scale_fmt else {})
  return dict(doc, quantization_config=quantization) if fp8 else doc


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


def write_index_and_config(dst_dir: str, weight_map: dict, total_size: int, config: dict) -> None:
  """`model.safetensors.index.json` and `config.json` of a Hugging Face export, in `dst_dir` (local, or objects
  under gs://)."""
  index = {"metadata": {"total_size": total_size, "producer": "inspect_checkpoint"}, "weight_map": weight_map}
  for name, doc in ((INDEX_NAME, index), ("config.json", config)):
    atomic.write_inside(dst_dir, name, json.dumps(doc, indent=2) + "\n")


@dataclasses.dataclass(frozen=True)
class HfWritten:
  """What a safetensors writer wrote: the shard files, tensor counts (FP8 matrices; FP4 experts, DeepSeek-V4), their
  bytes, `config.json`, each tensor's origin (MaxText key, shape, dtype: the manifest) and the index's weight map."""

  files: list
  num_tensors: int
  num_fp8: int
  total_size: int
  config: dict
  origins: dict
  weight_map: dict
  num_fp4: int | None = None

  def summary(self) -> dict:
    """The report's fields: files and counts (the config, origins and weight map are files of their own)."""
    counts = {"num_fp8": self.num_fp8, **({} if self.num_fp4 is None else {"num_fp4": self.num_fp4})}
    return {"files": self.files, "num_tensors": self.num_tensors, **counts, "total_size": self.total_size}


def write_deepseek_fp8(arrays: Mapping[tuple[str, ...], Any], cfg, dst_dir: str, *,
                       max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, mtp_shared_copies: bool = True,
                       work_bytes: int = DEFAULT_WORK_BYTES,
                       header_reserve: int = safetensors_writer.DEFAULT_HEADER_RESERVE,
                       chunk_shape: Callable[[tuple[str, ...]], Sequence[int] | None] | None = None,
                       read_overhead: Callable[[tuple[str, ...], Sequence[int]], int] | None = None,
                       progress: Callable[[int, int, str], None] | None = None,
                       fp8: bool = True, tally=None, scale_fmt: str | None = None, digests=None) -> dict[str, Any]:
  """Writes `arrays` (MaxText leaf key -> float array) as an FP8 (bf16 with `fp8=False`) Hugging Face DeepSeek
  checkpoint in `dst_dir`.

  Memory holds at most two blocks of a leaf (the next read while the current is converted) and the units of work
  under way: FP8 leaves are read in blocks (what `work_bytes` leaves beside `budget.SLICE_FACTOR` times one matrix,
  halved, at most `hf_matrices.MAX_READ_BYTES` or two whole source chunks; at least one matrix, then without
  reading ahead) and quantized one matrix (a layer's projection, or one routed expert) per converter, two where
  `work_bytes` holds a second matrix's work (`hf_matrices.write_leaf`); other tensors are converted by rows, a
  tenth of `work_bytes` (at most `MAX_ROW_BLOCK_BYTES`) of float32 at once. Every tensor is written to its shard
  as soon as it is converted (`safetensors_writer`). `plan_memory` gives `work_bytes` for a `--max-memory`.

  Args:
    arrays: every leaf of `cfg`'s model, keyed as `params.param_leaves(..., include_non_params=True)` keys it
      (the DeepSeek-V3 gate bias under nnx_aux/model or params/params). It may be lazy: each key is fetched
      once, then indexed by blocks (layers, experts, rows), so array-likes that read on indexing stay small.
    cfg: the `ModelConfig` the arrays belong to.
    dst_dir: an existing empty directory.
    max_shard_bytes: a shard is closed before a tensor would take it past this size.
    mtp_shared_copies: also write the MTP layers' copies of embed_tokens and shared_head.head, as the release.
    work_bytes: memory for reading and converting (beyond what the process already holds).
    header_reserve: bytes reserved for each shard's header (a shard is closed early when they are full).
    chunk_shape: the source's chunk shape of a leaf key (None: unknown), which the blocks read align to.
    read_overhead: (key, block shape) -> bytes the source holds beyond a block while decoding it (default 0).
    progress: called as `progress(done, total, dotted_key)` before each leaf.
    fp8: False writes bfloat16, unquantized (`--layout deepseek-bf16`).
    tally: a `manifest.tally.Tally` that gets the quantizer's error figures of every quantized matrix.
    digests: a `manifest.digests.Digests` that hashes every tensor as it is written.
    scale_fmt: "ue8m0" (`--scale-fmt ue8m0`, DeepSeek-V3.1's layout): every scale a power of two (float32), and
      `scale_fmt: ue8m0` in config.json's quantization_config; None: DeepSeek-V3's absmax / 448.

  Returns:
    `HfWritten`: shard names, tensor and FP8 counts, bytes of tensor data, config.json, tensor name -> (MaxText key,
    its shape, its dtype), tensor name -> shard file.

  Raises:
    errors.ConfigError: a model feature with no Hugging Face DeepSeek equivalent.
    errors.MismatchError: a leaf that maps to nothing, a missing leaf, or a leaf of the wrong shape.
    errors.InputError: a shard, the index or config.json cannot be written.
  """
  _check_supported(cfg)
  plan = hf_names.leaf_plan(cfg, mtp_shared_copies)
  pairs = _match(list(arrays.keys()), plan)
  codec = hf_matrices.Codec(power_of_two=scale_fmt == "ue8m0") if fp8 else hf_matrices.Codec("bf16")
  with safetensors_writer.ShardedWriter(dst_dir, max_shard_bytes, header_reserve=header_reserve,
                                       digests=digests) as writer:
    for done, (key, target) in enumerate(pairs):
      if progress is not None:
        progress(done, len(pairs), ".".join(key))
      value, entry = source_lib.as_view(arrays[key]), plan[target]
      writer.origin = (key, tuple(value.shape), np.dtype(value.dtype).name)
      if tuple(value.shape) != entry.shape:
        raise errors.MismatchError(f"MaxText leaf {'.'.join(key)} has shape {tuple(value.shape)}; "
                                   f"the model of this config has {entry.shape}")
      chunk = chunk_shape(key) if chunk_shape else None
      overhead = functools.partial(read_overhead, key) if read_overhead else (lambda box: 0)
      if entry.rule.kind in (FP8, EXPERTS_FP8):
        spare = work_bytes - budget.SLICE_FACTOR * hf_matrices.unit_bytes(entry)
        hf_matrices.write_leaf(writer, value, entry, cfg, spare, chunk, codec, overhead, tally)
        continue
      # Rows are converted in blocks of `row_bytes`, read in boxes of about as much beside a stream's windows (what
      # `SLICE_FACTOR` blocks leave): boxes of a streamed array are not cut down to single rows.
      stream = value.stream_overhead or 0
      row_bytes = max(1, min(MAX_ROW_BLOCK_BYTES, (work_bytes - stream) // (budget.SLICE_FACTOR + 2)))
      hf_rows.write_leaf(writer, value, entry, cfg, row_bytes, chunk,
                         work_bytes - budget.SLICE_FACTOR * max(row_bytes, hf_matrices.unit_bytes(entry)), overhead)
    writer.origin = None
    for name, array in _synthesized(cfg):
      writer.add(name, array)
    weight_map = writer.close()
  num_fp8 = sum(name.endswith("_scale_inv") for name in weight_map)
  config = hf_config(cfg, fp8, scale_fmt)
  write_index_and_config(dst_dir, weight_map, writer.total_size, config)
  files = sorted(set(weight_map.values()))
  return HfWritten(files, len(weight_map), num_fp8, writer.total_size, config, writer.origins, weight_map)
