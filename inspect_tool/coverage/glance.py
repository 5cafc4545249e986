"""The DeepSeek groups of `rules`' verdict block: which parts of the model are quantized, with which types.

Groups, in order (those the model lacks are left out): dense stack, MoE attention (with the indexer,
compressors and mHC mixing of V3.2 / V4 as groups of their own), router, routed experts by weight (`wi_0`,
`wi_1`, `wo`: the three grouped matmuls MaxText logs as gmm0/1/2), shared experts, MTP block, head (and V4's
hyper head). They follow `--summary`'s parts (`trace.part_of`). With MaxText's rules for the config, a reason
names the key that decides it: `quantize_mtp=false`, `quantize_logits_proj=false`, `quantize_router_proj=false`.
"""

from __future__ import annotations

from inspect_tool.report import coverage_verdict

_PART_NAMES = {
    "dense stack": "dense stack",
    "dense stack: indexer": "dense stack indexer",
    "dense stack: mHC mixing": "dense stack mHC mixing",
    "moe stack: attention and norms": "MoE attention",
    "moe stack: indexer": "MoE indexer",
    "moe stack: compressors": "MoE compressors",
    "moe stack: mHC mixing": "MoE mHC mixing",
    "moe stack: router": "router",
    "moe stack: shared experts": "shared experts",
    "head": "head",
    "head: mHC mixing": "hyper head (hc_head)",
}
ROUTED = "routed experts"
MTP = "MTP block"
ORDER = ("dense stack", "dense stack indexer", "dense stack mHC mixing", "MoE attention", "MoE indexer",
         "MoE compressors", "MoE mHC mixing", "router", f"{ROUTED} wi_0", f"{ROUTED} wi_1", f"{ROUTED} wo",
         "shared experts", MTP, "head", "hyper head (hc_head)")


def label(weight) -> str | None:
  """The verdict group of a `coverage_report.WeightRow` (its `part` is `trace.part_of`'s)."""
  if weight.part.startswith("mtp block"):
    return MTP
  if weight.part == "moe stack: routed experts":
    return f"{ROUTED} {weight.weight.rsplit('/', 1)[-1]}"
  return _PART_NAMES.get(weight.part, weight.part or weight.group)


def verdicts(cfg, report, *, config_rules: bool = True) -> tuple:
  """The verdicts (`inspect_tool.report.coverage_verdict.Verdict`) of a report traced for `cfg`.

  `config_rules`: the report's rules are MaxText's for the config, so the keys behind a reason can be named.
  """
  def reword(name: str, reason) -> str:
    if not config_rules:
      return reason.text
    fp8_full = cfg.quantization == "fp8_full"
    if name == MTP and reason.kind == "no_match" and cfg.quantization:
      return "quantize_mtp=false" if fp8_full else (f"no rule matches (quantization={cfg.quantization} covers "
                                                    "decoder/.*layers.* only)")
    if name == "head" and reason.kind == "no_match" and fp8_full and not cfg.quantize_logits_proj:
      return "quantize_logits_proj=false"
    if reason.kind == "no_weight_qtype" and not cfg.quantize_router_proj:  # MaxText's all-None router rule
      return f"quantize_router_proj=false ({reason.text})"
    return reason.text

  out = coverage_verdict.build(report, label, ORDER, reword)
  if not getattr(cfg, "mtp_num_layers", 0) and not any(v.name == MTP for v in out):
    head = [i for i, v in enumerate(out) if v.name.endswith("head")]
    at = head[0] if head else len(out)
    out = out[:at] + (coverage_verdict.Verdict(MTP, 0, 0, reasons=("no MTP block (mtp_num_layers=0)",)),) + out[at:]
  return out
