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

A scanned stack (`decoder/dense_layers`, `decoder/moe_layers`) inserts its own name (`dense_layers`,
`moe_layers`; MaxText's rules map both to no mesh axis) at `min(param_scan_axis, rank)` for Params and at 0
for other state (the gate bias), where the stacking put the layer axis.
"""

from __future__ import annotations

import re

from inspect_tool.paramtree import tree

Axes = tuple[str | None, ...] | None  # None: the variable carries no names (MaxText gives it P())

_MLP = {"wi_0": ("embed", "mlp"), "wi_1": ("embed", "mlp"), "wi": ("embed", "mlp"), "wo": ("mlp", "embed")}
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
}
_TOP = {
    "token_embedder/embedding": ("vocab", "embed_vocab"),
    "decoder/decoder_norm/scale": ("norm",),
    "decoder/logits_dense/kernel": ("embed_vocab", "vocab"),
}
_STACK = re.compile(r"decoder/(dense_layers|moe_layers)(_\d+)?/(.+)")
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


def _layer_axes(rest: str, cfg) -> Axes:
  wi, wo = routed_expert_axes(cfg)
  experts = {"DeepSeekMoeBlock_0/MoeBlock_0/wi_0": wi, "DeepSeekMoeBlock_0/MoeBlock_0/wi_1": wi,
             "DeepSeekMoeBlock_0/MoeBlock_0/wo": wo}
  if rest in experts:
    return experts[rest]
  if rest == "self_attention/out/kernel" and int(cfg.ici_context_autoregressive_parallelism) > 1:
    return (None, None, None)
  if rest not in _LAYER:
    raise UnknownVariable(rest)
  return _LAYER[rest]


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
  mtp = _MTP.fullmatch(path)
  if mtp:
    rest = mtp.group(2)
    if rest in _MTP_OWN:
      return _MTP_OWN[rest]
    if rest.startswith("transformer_layer/"):
      return _layer_axes(rest[len("transformer_layer/"):], cfg)
  raise UnknownVariable(path)
