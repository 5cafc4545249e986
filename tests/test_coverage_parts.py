"""The coverage summary's parts (`rules`): the parts `--summary` names, for DeepSeek-V3.2, DeepSeek-V4 and
deepseek-custom, with their parameter counts checked against MaxText 0.2.5's listings (tests/data/listings/)."""

import collections
import functools
import math
import re

import pytest

import maxtext_listings

from inspect_tool.configuration import config
from inspect_tool.coverage import trace as coverage
from inspect_tool.paramtree import summary
from inspect_tool.report import coverage_format

V32_SMALL = ["model_name=deepseek3.2-671b", "override_model_config=true", "mtp_num_layers=1", "base_emb_dim=64",
             "base_num_query_heads=4", "base_num_kv_heads=4", "base_mlp_dim=128", "base_moe_mlp_dim=32",
             "base_num_decoder_layers=3", "first_num_dense_layers=1", "vocab_size=512", "num_experts=8",
             "num_experts_per_tok=2", "q_lora_rank=32", "kv_lora_rank=16", "qk_nope_head_dim=32",
             "qk_rope_head_dim=16", "v_head_dim=32", "indexer_n_heads=4", "indexer_head_dim=32", "indexer_topk=8"]
CASES = {  # name: (MaxText's listing of the model, its keys)
    "v4": ("deepseek4-tiny_scan_mtp0.txt", ["model_name=deepseek4-tiny"]),
    "v4-noscan": ("deepseek4-tiny_noscan_mtp0.txt", ["model_name=deepseek4-tiny", "scan_layers=false"]),
    "v32": ("../ckpt_v32-small/listing.txt", V32_SMALL + ["quantize_mtp=true"]),
    "custom": ("deepseek-custom_scan_mtp0.txt", ["model_name=deepseek-custom", "override_model_config=true",
                                                 "engram_layers=[]"]),
}


@functools.lru_cache(maxsize=None)
def _report(case):
  return coverage.trace_coverage(config.resolve_config(CASES[case][1] + ["quantization=fp8_full"]))


def _listing_params_by_part(case):
  """MaxText's listing summed by the part each of its parameter paths belongs to."""
  sums = collections.Counter()
  for key, shape, _ in maxtext_listings.entries(CASES[case][0]):
    path = key.removeprefix("params.params.").replace(".", "/")
    sums[coverage.part_of(path)] += math.prod(shape)
  return sums


def _listing_params(case, pattern):
  """Parameters of MaxText's listing whose dotted key matches `pattern` (re.search)."""
  return sum(math.prod(shape) for key, shape, _ in maxtext_listings.entries(CASES[case][0]) if re.search(pattern, key))


def _parts_of(report):
  return {w.weight: (w.group, w.part) for w in report.weights}


def test_v4_weights_fall_into_the_parts_summary_names():
  parts = _parts_of(_report("v4"))
  csa = "decoder/scanned_blocks/layers_1/self_attention/csa_compressor"
  assert parts["decoder/hc_head/hc_fn"] == ("head", "head: mHC mixing")
  assert parts["decoder/logits_dense/kernel"] == ("head", "head")
  assert parts[f"{csa}/kv_proj/kernel"] == ("decoder", "moe stack: compressors")
  assert parts[f"{csa}/indexer/q_proj/kernel"] == ("decoder", "moe stack: indexer")
  assert parts["decoder/scanned_blocks/layers_0/self_attention/hca_compressor/gate_proj/kernel"] == (
      "decoder", "moe stack: compressors")
  assert parts["decoder/layers_0/mlp/MoeBlock_0/gate/kernel"] == ("decoder", "moe stack: router")
  assert parts["decoder/layers_0/mlp/MoeBlock_0/wi_0"] == ("decoder", "moe stack: routed experts")
  assert parts["decoder/layers_2/mlp/shared_experts/wo/kernel"] == ("decoder", "moe stack: shared experts")
  assert parts["decoder/layers_0/self_attention/o_a_proj/kernel"] == ("decoder", "moe stack: attention and norms")
  params = {p.part: p.params for p in _report("v4").parts}
  assert params["moe stack: compressors"] == _listing_params("v4", r"_compressor\.(kv|gate)_proj\.kernel$")
  assert params["moe stack: indexer"] == _listing_params("v4", r"\.indexer\.\w+\.kernel$") == 220416
  assert params["head: mHC mixing"] == 256 * 4  # hc_fn (hc_base and hc_scale are no matmul weights)
  # The hash-routing table is no Param and no op's weight: the classifier still names its part.
  assert coverage.part_of("decoder/layers_0/mlp/MoeBlock_0/tid2eid") == "moe stack: hash routing tables"


def test_v32_and_custom_indexer_and_mhc_parts():
  parts = _parts_of(_report("v32"))
  assert parts["decoder/dense_layers/self_attention/indexer/wq_b/kernel"] == ("decoder", "dense stack: indexer")
  assert parts["decoder/moe_layers/self_attention/indexer/wk/kernel"] == ("decoder", "moe stack: indexer")
  assert parts["mtp_block/mtp_layer_1/mtp_1_transformer_layer/self_attention/indexer/weights_proj/kernel"] == (
      "mtp", "mtp block: indexer")
  assert parts["decoder/dense_layers/mlp/wi_0/kernel"] == ("decoder", "dense stack")
  custom = _report("custom")
  assert _parts_of(custom)["decoder/moe_layers/self_attention/indexer/wq_b/kernel"] == ("decoder",
                                                                                        "moe stack: indexer")
  # The mHC mixing matrices are read by einsums whose operand is no Param: they are "other" params, by part.
  others = dict(custom.other_params_by_part)
  assert others["moe stack: mHC mixing"] > 0 and others["dense stack: mHC mixing"] > 0


@pytest.mark.parametrize("case", list(CASES))
def test_part_params_equal_maxtexts_listing_and_sum_to_their_group(case):
  report = _report(case)
  matmul = collections.Counter()
  for part in report.parts:
    matmul[part.part] += part.params
  ours = matmul + collections.Counter(dict(report.other_params_by_part))
  assert dict(ours) == dict(_listing_params_by_part(case))
  for group in report.groups:
    parts = [p for p in report.parts if p.group == group.group]
    for field in ("weights", "quantized_weights", "params", "quantized_params", "flops_per_token",
                  "quantized_flops_per_token"):
      assert sum(getattr(p, field) for p in parts) == getattr(group, field), (group.group, field)
  assert sum(g.params for g in report.groups) == report.total.params
  assert report.other_params == sum(n for _, n in report.other_params_by_part)


def test_v4_text_json_and_markdown_name_the_parts():
  report = _report("v4")
  text = coverage_format.to_text(report)
  assert "    moe stack: compressors" in text and "    head: mHC mixing" in text
  unquantized = text.split("Unquantized matmul weights")[1].split("Quantized share")[0]
  assert "head     head: mHC mixing" in unquantized and "decoder/hc_head/hc_fn" in unquantized
  data = coverage_format.to_json_data(report)
  assert data["schema_version"] == 1 and list(data["summary"]["groups"]) == ["decoder", "mtp", "head"]
  decoder = data["summary"]["parts"]["decoder"]
  assert sum(p["params"] for p in decoder.values()) == data["summary"]["groups"]["decoder"]["params"]
  assert decoder["moe stack: compressors"]["params_share"] == 1.0
  hc_fn = next(w for w in data["unquantized_weights"] if w["weight"] == "decoder/hc_head/hc_fn")
  assert (hc_fn["group"], hc_fn["part"]) == ("head", "head: mHC mixing")
  assert "| &nbsp;&nbsp;moe stack: indexer |" in coverage_format.to_markdown(report)


def test_strict_keeps_flagging_the_unquantized_grouped_output_projection():
  """MaxText's rules leave V4's grouped `o_a_proj` (an einsum) unquantized inside the layers; the heads are outside."""
  findings = _report("v4").strict_findings()
  assert len(findings) == 5 and all("o_a_proj" in f and "(moe stack: attention and norms, " in f for f in findings)
  assert summary.classify_path("decoder/hc_head/hc_fn") == ("head", "mHC mixing")
