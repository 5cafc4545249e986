"""What cannot be built here, refused in one line before any work starts.

* Numbers: every float key must be finite (`routed_scaling_factor=nan` would run and report `loss nan`);
  every integer key must fit in int64.
* Sizes: no array may hold 2^62 elements or more (shapes past int64 break XLA's size arithmetic), no dimension
  may pass 2^31 - 1 (JAX indexes dimensions with int32: `num_experts=3000000000` broke the router's `top_k`), and
  `scan_layers=false` builds one Python module per layer, so at most `MAX_UNSCANNED_LAYERS` decoder layers are
  built that way (`base_num_decoder_layers=100000 scan_layers=false` would not finish), and as many MTP layers
  (the MTP block is never scanned).

What a run needs in memory is `run.limits`'s; what the host has, `host.memory`'s.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from inspect_tool import errors

INT64_MAX = 2**63 - 1
INT32_MAX = 2**31 - 1  # the largest dimension a traced program indexes (JAX's int32 indices)
MAX_ELEMENTS = 2**62
MAX_UNSCANNED_LAYERS = 512


def _numbers(name: str, value: Any):
  if isinstance(value, (list, tuple)):
    for item in value:
      yield from _numbers(name, item)
  elif isinstance(value, (int, float)) and not isinstance(value, bool):
    yield name, value


def check_numbers(values: dict[str, Any]) -> None:
  """Finite floats and int64 integers in every key (lists and tuples included)."""
  for key, value in values.items():
    for name, number in _numbers(key, value):
      if isinstance(number, float) and not math.isfinite(number):
        raise errors.ConfigError(f"{name}={number} is not a finite number")
      if isinstance(number, int) and not -INT64_MAX <= number <= INT64_MAX:
        raise errors.ConfigError(f"{name}={errors.shown(number)} does not fit in a 64-bit integer")


def _largest_arrays(cfg) -> dict[str, int]:
  """Element counts of the largest arrays the model would hold (per kind), from the config alone."""
  emb, layers = cfg.emb_dim, max(cfg.num_decoder_layers, 1)
  heads = max(cfg.num_query_heads, 1)
  return {  # what: (elements, the keys that size it)
      "token embedding / logits head": (cfg.vocab_size * emb, "vocab_size × base_emb_dim"),
      "routed experts": (layers * cfg.num_experts * emb * max(cfg.moe_mlp_dim, 1),
                         "base_num_decoder_layers × num_experts × base_emb_dim × base_moe_mlp_dim"),
      "dense MLP": (layers * emb * max(cfg.mlp_dim, 1), "base_num_decoder_layers × base_emb_dim × base_mlp_dim"),
      "attention": (layers * heads * max(cfg.qk_head_dim, cfg.v_head_dim, 1) * max(emb, cfg.q_lora_rank, 1),
                    "base_num_decoder_layers × base_num_query_heads × the head dims × base_emb_dim"),
  }


def check_config_numbers(cfg) -> None:
  """Refuses a config with a number that is not finite or past int64 (checked before any other rule, so that no
  message quotes a 4000-digit number)."""
  fields = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name != "passthrough"}
  check_numbers(fields)
  check_numbers(dict(getattr(cfg, "passthrough", {}) or {}))


def check_config(cfg) -> None:
  """Refuses a config whose model could not be built (see module doc); `check_config_numbers` ran first."""
  for what, (count, keys) in _largest_arrays(cfg).items():
    if count >= MAX_ELEMENTS:
      raise errors.ConfigError(f"the model's {what} would hold {count:.3g} elements (>= 2^62; {keys}); "
                               "no array that large can be built")
  if not cfg.scan_layers:
    for given, layers in ((f"base_num_decoder_layers={cfg.base_num_decoder_layers}", cfg.num_decoder_layers),
                          (f"mtp_num_layers={cfg.mtp_num_layers}", cfg.mtp_num_layers)):
      if layers > MAX_UNSCANNED_LAYERS:
        raise errors.ConfigError(f"{given} with scan_layers=false would build {layers} layer modules one by one; "
                                 f"at most {MAX_UNSCANNED_LAYERS} are built that way (use scan_layers=true)")
  if cfg.mtp_num_layers > MAX_UNSCANNED_LAYERS:
    raise errors.ConfigError(f"mtp_num_layers={cfg.mtp_num_layers} would build as many MTP layer modules one by one "
                             "(MaxText's MTP block is never scanned); largest accepted: "
                             f"mtp_num_layers={MAX_UNSCANNED_LAYERS}")
  for key, value, largest, what in _dimensions(cfg):
    if value > largest:
      raise errors.ConfigError(f"{key}={value}: {what} would pass 2^31-1, the largest dimension a traced program "
                               f"indexes (JAX's int32 indices); largest accepted: {key}={largest}")


_WIDTHS = {  # a key that is one array dimension by itself: what it sizes
    "vocab_size": "the vocabulary", "head_dim": "a head", "q_lora_rank": "the query latent",
    "kv_lora_rank": "the key/value latent", "qk_nope_head_dim": "a query/key head",
    "qk_rope_head_dim": "a query/key head's RoPE part", "v_head_dim": "a value head",
    "num_experts": "the router's scores", "indexer_n_heads": "the indexer's heads",
    "indexer_head_dim": "an indexer head", "indexer_topk": "the indexer's keys",
    "o_groups": "the output groups", "o_lora_rank": "the output latent",
    "max_position_embeddings": "the RoPE tables", "original_max_position_embeddings": "the RoPE tables",
    "max_target_length": "a sequence", "sliding_window_size": "the sliding window"}


def _dimensions(cfg) -> list[tuple[str, int, int, str]]:
  """(key, its value, the largest value accepted, what it sizes) for each array dimension a key sets, alone or
  scaled (`global_parameter_scale`) or summed or multiplied with another key."""
  def scaled(key: str, derived: int, what: str):
    base = getattr(cfg, key)
    factor = derived // base if base > 0 else 1
    return key, base, INT32_MAX // max(factor, 1), f"{what} ({derived} wide)"

  rows = [scaled("base_emb_dim", cfg.emb_dim, "the embedding"),
          scaled("base_num_query_heads", cfg.num_query_heads, "the query heads"),
          scaled("base_num_kv_heads", cfg.num_kv_heads, "the key/value heads"),
          scaled("base_mlp_dim", cfg.mlp_dim, "the dense MLP"),
          scaled("base_moe_mlp_dim", cfg.moe_mlp_dim, "an expert's MLP"),
          scaled("base_num_decoder_layers", cfg.num_decoder_layers, "the stack of layers")]
  rows += [(key, getattr(cfg, key), INT32_MAX, what) for key, what in _WIDTHS.items()]
  nope = max(cfg.qk_nope_head_dim, 0)
  rows.append(("qk_rope_head_dim", cfg.qk_rope_head_dim, INT32_MAX - nope,
               f"a query/key head (qk_nope_head_dim={cfg.qk_nope_head_dim} + qk_rope_head_dim)"))
  rows.append(("shared_experts", cfg.shared_experts, INT32_MAX // max(cfg.moe_mlp_dim, 1),
               f"the shared experts' MLP (shared_experts × {cfg.moe_mlp_dim})"))
  rows.append(("mhc_expansion_rate", cfg.mhc_expansion_rate, INT32_MAX // max(cfg.emb_dim, 1),
               f"the mHC streams (mhc_expansion_rate × {cfg.emb_dim})"))
  return rows
