"""Parameter summary by group: where the parameters of a DeepSeek tree live, what they weigh, what is active.

Groups follow the model's structure: embedding, dense stack, MoE stack (attention, router, routed experts,
shared experts), MTP block (same split) and head. Works on any `Leaf` list in MaxText's key convention —
a model's or a checkpoint's. `classify_path` is the one grouping of MaxText's '/'-joined parameter paths: the
Qwix coverage report (`model_coverage`) names its parts with it too.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable

from inspect_tool.paramtree import tree

# (group, part, pattern over the '/'-joined module path); first match wins.
# DeepSeek-V4's layers (`layers_<i>`, `scanned_blocks`) are all MoE layers; V3.2's indexer, V4's compressors, mHC
# mixing matrices and V4's hash-routing tables (`tid2eid`, not Params: listed with --all) are parts of their stack.
_MOE = r"decoder/(moe_layers[^/]*|layers_\d+|scanned_blocks)"
_GROUPS = (
    ("embedding", "", r"token_embedder/.*"),
    ("head", "mHC mixing", r"decoder/hc_head/.*"),
    ("head", "", r"decoder/(logits_dense|decoder_norm)/.*"),
    ("dense stack", "mHC mixing", r"decoder/dense_layers[^/]*/mhc_(attention|mlp)/.*"),
    ("dense stack", "indexer", r"decoder/dense_layers[^/]*/self_attention/indexer/.*"),
    ("dense stack", "", r"decoder/dense_layers.*"),
    ("moe stack", "mHC mixing", _MOE + r"/(layers_\d+/)?mhc_(attention|mlp)/.*"),
    ("moe stack", "indexer", _MOE + r"/.*/indexer/.*"),
    ("moe stack", "compressors", _MOE + r"/.*/(hca|csa)_compressor/.*"),
    ("moe stack", "hash routing tables", _MOE + r"/.*/MoeBlock_0/tid2eid"),
    ("moe stack", "router", _MOE + r"/.*/MoeBlock_0/gate/.*"),
    ("moe stack", "routed experts", _MOE + r"/.*/MoeBlock_0/.*"),
    ("moe stack", "shared experts", _MOE + r"/.*/shared_experts/.*"),
    ("moe stack", "attention and norms", _MOE + r".*"),
    ("mtp block", "indexer", r"mtp_block/.*/indexer/.*"),
    ("mtp block", "router", r"mtp_block/.*/MoeBlock_0/gate/.*"),
    ("mtp block", "routed experts", r"mtp_block/.*/MoeBlock_0/.*"),
    ("mtp block", "shared experts", r"mtp_block/.*/shared_experts/.*"),
    ("mtp block", "attention, norms and projection", r"mtp_block/.*"),
)
_COMPILED = tuple((g, p, re.compile(pattern)) for g, p, pattern in _GROUPS)
_GROUP_ORDER = tuple(dict.fromkeys(g for g, _, _ in _GROUPS)) + ("other",)
GROUP_PARTS = tuple(dict.fromkeys((g, p) for g, p, _ in _GROUPS)) + (("other", ""),)  # every (group, part), in order
_PART_ORDER = tuple(dict.fromkeys(p for _, p, _ in _GROUPS)) + ("embedding and head copies",)
GROUP_ORDER, PART_ORDER = _GROUP_ORDER, _PART_ORDER  # the order other per-group tables follow
_BYTES = {"float64": 8, "int64": 8, "uint64": 8, "float32": 4, "int32": 4, "uint32": 4, "bfloat16": 2,
          "float16": 2, "int16": 2, "int8": 1, "uint8": 1, "bool": 1}


def dtype_bytes(dtype: str) -> float:
  if dtype.startswith("float8"):
    return 1
  if dtype in ("int4", "uint4", "float4_e2m1fn"):
    return 0.5
  return _BYTES.get(dtype, 4)


def classify_path(path: str) -> tuple[str, str]:
  """(group, part) of a '/'-joined parameter path such as `decoder/hc_head/hc_fn`; part "" for none."""
  for group, part, pattern in _COMPILED:
    if pattern.fullmatch(path):
      return group, part
  return "other", ""


def group_of(leaf: tree.Leaf) -> tuple[str, str]:
  return classify_path("/".join(leaf.module_path))


@dataclasses.dataclass(frozen=True)
class GroupRow:
  group: str
  part: str  # "" for the group's total row
  params: int  # FP8 scales excluded (see `scales`)
  bytes: float  # at the stored dtype, scales included
  bytes_bf16: int
  bytes_fp8: float | None  # weights the rules quantize at their qtype plus scales, the rest stored; None: unknown
  scales: int = 0  # values of the FP8 scale arrays (an export's `array/scale`, safetensors' `weight_scale_inv`)

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Summary:
  """Per-group parameter counts and sizes, totals and (given the routing fraction) active parameters."""

  rows: tuple[GroupRow, ...]
  total_params: int
  total_bytes: float
  active_params: int | None  # per token, main model (no MTP)
  active_params_with_mtp: int | None
  routed_fraction: float | None  # num_experts_per_tok / num_experts
  total_scales: int = 0  # scale values, apart from total_params
  total_bytes_fp8: float | None = None
  fp8_basis: str | None = None  # what decided the fp8 column (None: unknown)

  def to_dict(self) -> dict:
    return {"groups": [r.to_dict() for r in self.rows], "total_params": self.total_params,
            "total_scales": self.total_scales, "total_bytes": self.total_bytes,
            "total_bytes_fp8": self.total_bytes_fp8, "fp8_basis": self.fp8_basis,
            "active_params_per_token": self.active_params,
            "active_params_per_token_with_mtp": self.active_params_with_mtp,
            "routed_expert_fraction": self.routed_fraction}


def summarize(leaves: list[tree.Leaf], *, routed_fraction: float | None = None, all_leaves: bool = False,
              classify: Callable[[tree.Leaf], tuple[str, str]] = group_of, scales=frozenset(),
              fp8=None) -> Summary:
  """Sums parameter leaves (`params.params.*`, or every leaf with `all_leaves`) by group; others are ignored.

  `routed_fraction` (experts per token / experts) turns routed-expert counts into active parameters per token:
  every other parameter is counted as active. `classify` maps a leaf to its (group, part) (MaxText keys by
  default; `hf.layout.classifier` for Hugging Face names). Leaves whose key is in `scales` count as
  scales, not parameters (their bytes are counted). `fp8` (`fp8_size.Fp8Sizing`) sizes the fp8 column; None: unknown.
  """
  sums: dict[tuple[str, str], list[float]] = {}  # params, bytes, fp8 bytes, scales
  for leaf in leaves:
    if not (leaf.is_param or all_leaves):
      continue
    group, part = classify(leaf)
    is_scale = leaf.key in scales
    for key in ((group, ""), (group, part)) if part else ((group, ""),):
      acc = sums.setdefault(key, [0, 0.0, 0.0, 0])
      acc[0 if not is_scale else 3] += leaf.size
      acc[1] += leaf.size * dtype_bytes(leaf.dtype)
      acc[2] += fp8.bytes_of(leaf) if fp8 is not None else 0
  keys = sorted(sums, key=lambda k: (_GROUP_ORDER.index(k[0]), k[1] != "", _PART_ORDER.index(k[1]) if k[1] else 0))
  rows = tuple(GroupRow(g, p, int(n), stored, int(n) * 2, fp8_bytes if fp8 is not None else None, int(s))
               for (g, p), (n, stored, fp8_bytes, s) in ((k, sums[k]) for k in keys))
  total = sum(r.params for r in rows if not r.part)
  total_bytes = sum(r.bytes for r in rows if not r.part)
  total_scales = sum(r.scales for r in rows if not r.part)
  total_fp8 = sum(r.bytes_fp8 for r in rows if not r.part) if fp8 is not None else None
  active = active_mtp = None
  if routed_fraction is not None:
    def inactive(group: str) -> float:
      routed = sums.get((group, "routed experts"), [0, 0])[0]
      return routed * (1.0 - routed_fraction)
    mtp_total = sums.get(("mtp block", ""), [0, 0])[0]
    active_mtp = int(round(total - inactive("moe stack") - inactive("mtp block")))
    active = int(round(total - mtp_total - inactive("moe stack")))
  return Summary(rows, total, total_bytes, active, active_mtp, routed_fraction, total_scales, total_fp8,
                 fp8.basis if fp8 is not None else None)


def human(n: float, sep: str = "") -> str:
  """1234567 -> '1.23M' (`sep=" "`: '1.23 M', as the listings' totals print counts)."""
  for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
    if abs(n) >= scale:
      return f"{n / scale:.2f}{sep}{unit}"
  return f"{n:.0f}"


def human_bytes(n: float) -> str:
  for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
    if abs(n) >= scale:
      return f"{n / scale:.2f} {unit}"
  return f"{n:.0f} B"
