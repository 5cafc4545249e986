"""MaxText 0.2.5's logical axis names for every variable of the DeepSeek tree.

Per layer, the names are those MaxText's modules give their variables (`out_sharding` / `kernel_axes`):

| variable | logical axes |
|---|---|
| norms' `scale` (layer, q/kv LoRA, decoder, MTP) | `norm` |
| `wq_a` / `wkv_a` | `embed_attn`, `q_lora_up_proj` / `kv_lora_up_proj` |
| `wq_b` (MLA and indexer) | `q_lora`, `q_heads`, `kv` |
| `query` (no q LoRA) | `embed_attn`, `q_heads`, `kv` |
| `wkv_b` | `kv_lora`, `kv_heads`, `kv_head_dim` |
| `out` | `heads`, `kv`, `embed_attn` (all None with `ici_context_autoregressive_parallelism` > 1) |
| indexer `wk` / `weights_proj` | `embed_attn`, `kv` / `q_heads`; its `k_norm` has none (replicated) |
| dense and shared-expert MLP `wi_*` / `wo` | `embed`, `mlp` / `mlp`, `embed` |
| router `gate.kernel` / `gate.bias` | `embed_router`, None / None |
| routed `wi_*` / `wo` | `exp`, `embed_moe`, `mlp_moe` / `exp`, `mlp_moe`, `embed_moe` (or `routed_expert_axes`) |
| `token_embedder.embedding` / `logits_dense` | `vocab`, `embed_vocab` / `embed_vocab`, `vocab` |
| `mtp_k_projection` | `embed`, None |
| mHC `mhc_norm.scale` / `{res,pre,post}_alpha` / their scales, betas | `norm` / `activation_embed`, None / None |
| V4 hyper head `hc_head`: `hc_fn` / `hc_base`, `hc_scale` | `activation_embed`, None / None |

DeepSeek-V4 layers (`decoder/layers_N`, `decoder/scanned_blocks/layers_N`) have their own attention
(`CompressedAttention`) and name their MoE block `mlp`:

| variable | logical axes |
|---|---|
| `wq_a` / `wq_b` | `embed_attn`, `q_lora` / `q_lora`, `q_heads`, `kv` |
| `wkv` | `embed_attn`, `kv_heads`, `kv_head_dim` |
| `o_a_proj` (grouped) / `o_b_proj` | `o_groups`, `q_heads`, `o_lora_up_proj` / `o_lora_up_proj`, `embed_attn` |
| `sinks` | None |
| compressor and indexer `kv_proj`, `gate_proj` | `embed_attn`, `kv` |
| indexer `q_proj` / `weights_proj` | `q_lora`, `indexer_q` / `embed_attn`, `indexer_weights` |
| `position_bias`, hash-routing `tid2eid` | none (replicated, `P()`) |

A scanned stack (`decoder/dense_layers`, `decoder/moe_layers`, V4's `decoder/scanned_blocks`) inserts its own
name (`dense_layers`, `moe_layers`, `scanned_blocks`; MaxText's rules map them to no mesh axis) at
`min(param_scan_axis, rank)` for Params and at 0 for other state (the gate bias), where the stacking put the
layer axis; a variable without names stays `P()`.
"""

from __future__ import annotations

import re

from inspect_tool.paramtree import tree

Axes = tuple[str | None, ...] | None  # None: the variable carries no names (MaxText gives it P())

_MLP = {"wi_0": ("embed", "mlp"), "wi_1": ("embed", "mlp"), "wi": ("embed", "mlp"), "wo": ("mlp", "embed")}
_MHC = {
    "mhc_norm/scale": ("norm",),
    **{f"{kind}_alpha": ("activation_embed", None) for kind in ("res", "pre", "post")},
    **{f"{kind}_alpha_scale": (None,) for kind in ("res", "pre", "post")},
    "res_beta": (None, None),  # (k, k): MaxText's mHC-lite (a permutation vector) is refused by the model
    "pre_beta": (None,),
    "post_beta": (None,),
}
_MHC_LAYER = {f"{block}/{name}": axes for block in ("mhc_attention", "mhc_mlp") for name, axes in _MHC.items()}
_LAYER = {
    "pre_self_attention_layer_norm/scale": ("norm",),
    "post_self_attention_layer_norm/scale": ("norm",),
    "self_attention/q_norm/scale": ("norm",),
    "self_attention/kv_norm/scale": ("norm",),
    "self_attention/wq_a/kernel": ("embed_attn", "q_lora_up_proj"),
    "self_attention/wq_b/kernel": ("q_lora", "q_heads", "kv"),
    "self_attention/query/kernel": ("embed_attn", "q_heads", "kv"),
    "self_attention/wkv_a/kernel": ("embed_attn", "kv_lora_up_proj"),
    "self_attention/wkv_b/kernel": ("kv_lora", "kv_heads", "kv_head_dim"),
    "self_attention/out/kernel": ("heads", "kv", "embed_attn"),
    "self_attention/indexer/wq_b/kernel": ("q_lora", "q_heads", "kv"),
    "self_attention/indexer/wk/kernel": ("embed_attn", "kv"),
    "self_attention/indexer/weights_proj/kernel": ("embed_attn", "q_heads"),
    "self_attention/indexer/k_norm/scale": None,
    "self_attention/indexer/k_norm/bias": None,
    "DeepSeekMoeBlock_0/MoeBlock_0/gate/kernel": ("embed_router", None),
    "DeepSeekMoeBlock_0/MoeBlock_0/gate/bias": (None,),
    **{f"mlp/{name}/kernel": axes for name, axes in _MLP.items()},
    **{f"DeepSeekMoeBlock_0/shared_experts/{name}/kernel": axes for name, axes in _MLP.items()},
    **_MHC_LAYER,  # deepseek-custom (mhc_expansion_rate > 1)
}
_COMPRESSOR = {"kv_proj/kernel": ("embed_attn", "kv"), "gate_proj/kernel": ("embed_attn", "kv"),
               "position_bias": None, "kv_norm/scale": ("norm",)}
_V4_INDEXER = {**_COMPRESSOR, "q_proj/kernel": ("q_lora", "indexer_q"),
               "weights_proj/kernel": ("embed_attn", "indexer_weights")}
_V4_LAYER = {
    "pre_self_attention_layer_norm/scale": ("norm",),
    "post_self_attention_layer_norm/scale": ("norm",),
    **_MHC_LAYER,
    "self_attention/wq_a/kernel": ("embed_attn", "q_lora"),
    "self_attention/q_norm/scale": ("norm",),
    "self_attention/wq_b/kernel": ("q_lora", "q_heads", "kv"),
    "self_attention/wkv/kernel": ("embed_attn", "kv_heads", "kv_head_dim"),
    "self_attention/kv_norm/scale": ("norm",),
    "self_attention/sinks": (None,),
    "self_attention/o_a_proj/kernel": ("o_groups", "q_heads", "o_lora_up_proj"),
    "self_attention/o_b_proj/kernel": ("o_lora_up_proj", "embed_attn"),
    **{f"self_attention/hca_compressor/{name}": axes for name, axes in _COMPRESSOR.items()},
    **{f"self_attention/csa_compressor/{name}": axes for name, axes in _COMPRESSOR.items()},
    **{f"self_attention/csa_compressor/indexer/{name}": axes for name, axes in _V4_INDEXER.items()},
    "mlp/MoeBlock_0/gate/kernel": ("embed_router", None),
    "mlp/MoeBlock_0/gate/bias": (None,),
    "mlp/MoeBlock_0/tid2eid": None,
    **{f"mlp/shared_experts/{name}/kernel": axes for name, axes in _MLP.items()},
}
_TOP = {
    "token_embedder/embedding": ("vocab", "embed_vocab"),
    "decoder/hc_head/hc_fn": ("activation_embed", None),
    "decoder/hc_head/hc_base": (None,),
    "decoder/hc_head/hc_scale": (None,),
    "decoder/decoder_norm/scale": ("norm",),
    "decoder/logits_dense/kernel": ("embed_vocab", "vocab"),
}
_STACK = re.compile(r"decoder/(dense_layers|moe_layers)(_\d+)?/(.+)")
_V4_STACK = re.compile(r"decoder/(scanned_blocks/)?layers_\d+/(.+)")
_MTP = re.compile(r"mtp_block/mtp_layer_(\d+)/mtp_\1_(.+)")
_MTP_OWN = {"embedding_norm/scale": ("norm",), "hidden_state_norm/scale": ("norm",), "final_norm/scale": ("norm",),
            "projection/kernel": ("embed", None)}


class UnknownVariable(LookupError):
  """A variable this table has no logical axes for (a tree this module does not know)."""


def routed_expert_axes(cfg) -> tuple[tuple, tuple]:
  """(wi axes, wo axes) of the routed experts, by MaxText's MoE layout switches."""
  if cfg.shard_exp_on_fsdp:
    return ("embed_moe", None, "mlp_moe"), ("embed_moe", "mlp_moe", None)
  if cfg.use_2d_fsdp_sharding:
    return ("embed_moe", "mlp_moe", None), ("embed_moe", "mlp_moe", None)
  if cfg.use_batch_split_schedule:
    wo = ("expert_only", "embed_moe", None) if cfg.use_lineage else ("expert_only", None, "embed_moe")
    return ("expert_only", "embed_moe", None), wo
  return ("exp", "embed_moe", "mlp_moe"), ("exp", "mlp_moe", "embed_moe")


def _layer_axes(rest: str, cfg, table=None, moe_block: str = "DeepSeekMoeBlock_0") -> Axes:
  """Names of one layer's variable (`rest`: its path inside the layer) from `table` (DeepSeek's by default)."""
  wi, wo = routed_expert_axes(cfg)
  experts = {f"{moe_block}/MoeBlock_0/wi_0": wi, f"{moe_block}/MoeBlock_0/wi_1": wi, f"{moe_block}/MoeBlock_0/wo": wo}
  if rest in experts:
    return experts[rest]
  if rest == "self_attention/out/kernel" and int(cfg.ici_context_autoregressive_parallelism) > 1:
    return (None, None, None)
  table = _LAYER if table is None else table
  if rest not in table:
    raise UnknownVariable(rest)
  return table[rest]


def _insert_scan(axes: Axes, name: str, axis: int) -> Axes:
  if not axes:
    return axes
  out = list(axes)
  out.insert(min(axis, len(out)), name)
  return tuple(out)


def logical_axes(leaf: tree.Leaf, cfg) -> Axes:
  """The logical axis names MaxText attaches to `leaf` (scan axis included); `UnknownVariable` if none known."""
  path = "/".join(leaf.module_path)
  if path in _TOP:
    return _TOP[path]
  stack = _STACK.fullmatch(path)
  if stack:
    name, index, rest = stack.groups()
    axes = _layer_axes(rest, cfg)
    if index:  # one unscanned layer
      return axes
    return _insert_scan(axes, name, int(cfg.param_scan_axis) if leaf.is_param else 0)
  v4 = _V4_STACK.fullmatch(path)
  if v4:
    scanned, rest = v4.groups()
    axes = _layer_axes(rest, cfg, _V4_LAYER, moe_block="mlp")
    if not scanned:
      return axes
    return _insert_scan(axes, "scanned_blocks", int(cfg.param_scan_axis) if leaf.is_param else 0)
  mtp = _MTP.fullmatch(path)
  if mtp:
    rest = mtp.group(2)
    if rest in _MTP_OWN:
      return _MTP_OWN[rest]
    if rest.startswith("transformer_layer/"):
      return _layer_axes(rest[len("transformer_layer/"):], cfg)
  raise UnknownVariable(path)
