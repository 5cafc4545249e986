"""The MaxText size keys an Orbax checkpoint's shapes determine (MaxText's DeepSeek layout, scanned or not).

Each stack (`dense_layers`, `moe_layers`, their unscanned `dense_layers_i` / `moe_layers_i`, and MTP's
`mtp_layer_k` transformer layers) is read per layer: a scanned leaf without its layer axis (`param_scan_axis`
for Params, as detected from the stack's shapes; 0 for the MoE gate bias). Letters as `hf_names`:

* embedding (V, E): vocab_size, base_emb_dim; no `logits_dense`: logits_via_embedding
* wq_a (E, qr), or `query` (E, H, dq) and q_lora_rank 0; wq_b (qr, H, dq): heads; kv_norm (kr,): kv_lora_rank;
  wkv_a (E, kr + dr): qk_rope_head_dim, dn = dq - dr; wkv_b (kr, H, dn + dv): v_head_dim
* dense mlp wi_0 (E, F): base_mlp_dim; routed wi_0 (X, E, Fm): num_experts, base_moe_mlp_dim;
  shared wi_0 (E, S·Fm): shared_experts; gate bias stored or not: routed_bias
* indexer wq_b (qr, Hi, Di): use_indexer, indexer_n_heads, indexer_head_dim
* layer counts: first_num_dense_layers, base_num_decoder_layers; mtp_layer_k: mtp_num_layers; scan layout.

MLA shows no key/value heads: base_num_kv_heads follows the query heads when the model has them equal.
"""

from __future__ import annotations

import collections
import re
from typing import Any, Iterable

from inspect_tool.checkpoint import diff
from inspect_tool.paramtree import tree

_UNSCANNED = re.compile(r"^(dense|moe)_layers_(\d+)$")
_MTP = re.compile(r"^mtp_layer_(\d+)$")


def _body(leaf: tree.Leaf) -> tuple[str, ...] | None:
  if leaf.key[:2] in (tree.PARAMS_PREFIX, tree.AUX_PREFIX) and not diff.is_training_only(leaf):
    return leaf.key[2:]
  return None


def _layers(leaves: Iterable[tree.Leaf]) -> tuple[dict, dict, dict[str, Any]]:
  """({stack: {subpath: per-layer shape}}, {stack: layer count}, layout keys)."""
  leaves = list(leaves)
  axis = diff._scan_axis(leaves)  # pylint: disable=protected-access
  shapes: dict[str, dict[tuple[str, ...], tuple[int, ...]]] = collections.defaultdict(dict)
  counts: dict[str, set] = collections.defaultdict(set)
  layout: dict[str, Any] = {}
  for leaf in leaves:
    body = _body(leaf)
    if body is None or len(body) < 2 or body[0] not in ("decoder", "mtp_block"):
      continue
    part, sub, shape = body[1], body[2:], tuple(leaf.shape)
    if body[0] == "mtp_block" and _MTP.match(part) and len(body) > 2:
      counts["mtp"].add(int(_MTP.match(part)[1]))
      if sub[0].endswith("_transformer_layer"):
        shapes["moe"].setdefault(sub[1:], shape)
    elif part in ("dense_layers", "moe_layers"):
      layout["scan_layers"] = True
      stack = part.split("_")[0]
      layer_axis = 0 if sub[-2:] == ("gate", "bias") else min(axis if axis is not None else 1, len(shape) - 1)
      counts[stack].add(shape[layer_axis])
      shapes[stack].setdefault(sub, shape[:layer_axis] + shape[layer_axis + 1:])
      if axis is not None:
        layout["param_scan_axis"] = axis
    elif (m := _UNSCANNED.match(part)):
      layout["scan_layers"] = False
      counts[m[1] + "_index"].add(int(m[2]))
      shapes[m[1]].setdefault(sub, shape)
  sizes = {stack: max(counts[stack]) for stack in ("dense", "moe") if counts[stack]}
  for stack in ("dense", "moe"):
    if counts[stack + "_index"]:
      sizes[stack] = len(counts[stack + "_index"])
  sizes["mtp"] = max(counts["mtp"], default=0)
  return shapes, sizes, layout


def _attention(per_layer: dict, keys: dict[str, Any]) -> None:
  att = lambda name: per_layer.get(("self_attention", name, "kernel"))  # noqa: E731
  norm = lambda name: per_layer.get(("self_attention", name, "scale"))  # noqa: E731
  q_b = att("wq_b") if att("wq_a") else att("query")
  if att("wq_a") and len(att("wq_a")) == 2:
    keys["q_lora_rank"] = att("wq_a")[1]
  elif att("query"):
    keys["q_lora_rank"] = 0
  if q_b and len(q_b) == 3:
    keys["base_num_query_heads"] = q_b[1]
  kv_norm, wkv_a, wkv_b = norm("kv_norm"), att("wkv_a"), att("wkv_b")
  if kv_norm and len(kv_norm) == 1:
    keys["kv_lora_rank"] = kv_norm[0]
    if wkv_a and len(wkv_a) == 2 and q_b and len(q_b) == 3:
      dr = wkv_a[1] - kv_norm[0]
      keys["qk_rope_head_dim"], keys["qk_nope_head_dim"] = dr, q_b[2] - dr
      if wkv_b and len(wkv_b) == 3:
        keys["v_head_dim"] = wkv_b[2] - (q_b[2] - dr)
  index = per_layer.get(("self_attention", "indexer", "wq_b", "kernel"))
  if q_b:
    keys["use_indexer"] = index is not None
  if index and len(index) == 3:
    keys["indexer_n_heads"], keys["indexer_head_dim"] = index[1], index[2]


def infer(leaves: Iterable[tree.Leaf]) -> dict[str, Any]:
  """MaxText key -> value for every size key the checkpoint `leaves`' shapes show."""
  leaves = list(leaves)
  keys: dict[str, Any] = {}
  bodies = {_body(l): tuple(l.shape) for l in leaves if _body(l) is not None}
  embedding = bodies.get(("token_embedder", "embedding"))
  if embedding and len(embedding) == 2:
    keys["vocab_size"], keys["base_emb_dim"] = embedding
    keys["logits_via_embedding"] = ("decoder", "logits_dense", "kernel") not in bodies
  shapes, sizes, layout = _layers(leaves)
  dense, moe = shapes.get("dense", {}), shapes.get("moe", {})
  _attention(moe or dense, keys)
  wi = dense.get(("mlp", "wi_0", "kernel"))
  if wi and len(wi) == 2:
    keys["base_mlp_dim"] = wi[1]
  routed = ("DeepSeekMoeBlock_0", "MoeBlock_0")
  experts = moe.get(routed + ("wi_0",))
  if experts and len(experts) == 3:
    keys["num_experts"], keys["base_moe_mlp_dim"] = experts[0], experts[2]
    shared = moe.get(("DeepSeekMoeBlock_0", "shared_experts", "wi_0", "kernel"))
    keys["shared_experts"] = shared[1] // experts[2] if shared and len(shared) == 2 and experts[2] else 0
    keys["routed_bias"] = routed + ("gate", "bias") in moe
  if "dense" in sizes or "moe" in sizes:
    keys["first_num_dense_layers"] = sizes.get("dense", 0)
    keys["base_num_decoder_layers"] = sizes.get("dense", 0) + sizes.get("moe", 0)
  if layout or sizes["mtp"]:
    keys["mtp_num_layers"] = sizes["mtp"]
  keys.update(layout)
  return keys


# Inferred key -> the model attribute it sets (at global_parameter_scale 1).
_ATTRIBUTE = {"base_emb_dim": "emb_dim", "base_num_query_heads": "num_query_heads", "base_mlp_dim": "mlp_dim",
              "base_moe_mlp_dim": "moe_mlp_dim", "base_num_decoder_layers": "num_decoder_layers"}


def changed(cfg, keys: dict[str, Any]) -> dict[str, Any]:
  """The inferred `keys` whose values differ from `cfg`'s (base_num_kv_heads kept equal to the query heads)."""
  out = {k: v for k, v in keys.items() if getattr(cfg, _ATTRIBUTE.get(k, k)) != v}
  if not cfg.use_indexer:
    out.pop("indexer_n_heads", None)
    out.pop("indexer_head_dim", None)
  if "base_num_query_heads" in out and cfg.num_kv_heads == cfg.num_query_heads:
    out["base_num_kv_heads"] = out["base_num_query_heads"]
  if "num_experts" in out and cfg.num_experts_per_tok > out["num_experts"]:
    out["num_experts_per_tok"] = out["num_experts"]  # not in the shapes; the model needs top-k <= experts
  if keys.get("use_indexer") and not cfg.use_indexer:
    out.update({k: keys[k] for k in ("indexer_n_heads", "indexer_head_dim") if k in keys})
  return out
