"""Listing report formats: MaxText's exact text, output file, JSON schema, Markdown, --all grouping."""

import json

from inspect_tool.paramtree import tree
from inspect_tool.report import listing


def _leaves():
  return [
      tree.Leaf(tree.param_key(("decoder", "moe_layers_10", "w")), (2, 3), "float32"),
      tree.Leaf(tree.param_key(("decoder", "moe_layers_2", "w")), (2, 3), "float32"),
      tree.Leaf(tree.param_key(("decoder", "decoder_norm", "scale")), (7168,), "float32"),
      tree.Leaf(tree.aux_key(("decoder", "moe_layers", "gate", "bias")), (58, 256), "float32"),
      tree.Leaf(("step",), (), "int32"),
  ]


def test_text_is_maxtext_format_with_natural_sort_and_total():
  report = listing.build_report("x", _leaves(), include_all=False)
  text = listing.format_text(report, check_dtype=True)
  assert text.splitlines() == [
      "key: params.params.decoder.decoder_norm.scale | shape: (7168,) | dtype: float32",
      "key: params.params.decoder.moe_layers_2.w | shape: (2, 3) | dtype: float32",
      "key: params.params.decoder.moe_layers_10.w | shape: (2, 3) | dtype: float32",
      "Total Parameters: 7180 (~0.00 B)",  # MaxText's line, byte for byte
      "Total: 7.18 K parameters, 28.05 KiB as stored",  # ours: 7180 float32 values = 28720 B
  ]
  assert "| dtype" not in listing.format_text(report, check_dtype=False)


def test_total_line_matches_maxtext_rounding():
  assert listing.total_line(682636472320) == "Total Parameters: 682636472320 (~682.64 B)"
  assert listing.total_line(34004896) == "Total Parameters: 34004896 (~0.03 B)"


def test_all_groups_items_params_first():
  report = listing.build_report("x", _leaves(), include_all=True)
  lines = listing.format_text(report).splitlines()
  assert lines[0] == "# item: params (3 arrays)"
  assert lines.index("# item: nnx_aux (1 arrays)") < lines.index("# item: step (1 arrays)")
  assert "key: nnx_aux.model.decoder.moe_layers.gate.bias | shape: (58, 256)" in lines
  assert lines[-2] == "Total Parameters: 7180 (~0.00 B)"  # non-Param state is not counted


def test_output_file_has_command_header():
  report = listing.build_report("x", _leaves(), include_all=False)
  text = listing.format_output_file(report, "inspect_checkpoint maxtext a=b", check_dtype=False)
  assert text.startswith("# inspect_checkpoint maxtext a=b\n\nkey: params.params.decoder.decoder_norm.scale")


def test_json_schema():
  report = listing.build_report("src", _leaves(), include_all=True, routed_fraction=0.5)
  data = json.loads(listing.format_json(report))
  assert data["schema_version"] == 1 and data["source"] == "src" and data["total_parameters"] == 7180
  assert {p["item"] for p in data["parameters"]} == {"params", "nnx_aux", "step"}
  assert data["summary"]["routed_expert_fraction"] == 0.5


def test_markdown_has_tables():
  md = listing.format_markdown(listing.build_report("src", _leaves(), include_all=False))
  assert "| `params.params.decoder.decoder_norm.scale` | (7168,) | float32 |" in md
  assert "## Summary by group" in md
