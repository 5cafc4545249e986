"""Quantization that fits the chip: the matrix-unit table (held to docs/coverage.md's sourced table), how each
(weight, activation) type pair runs on each chip, the advice, and `rules` / `maxtext --summary` with `--chip` or
`--topology`."""

import json
import pathlib
import re

import pytest

from inspect_tool import errors
from inspect_tool.sharding import matrix_units

from test_rules_glance import _tables
from conftest import run_cli
from conftest import REPO

DOCS = pathlib.Path(REPO) / "docs" / "coverage.md"
TINY = ["model_name=deepseek3-tiny", "mtp_num_layers=1", "override_model_config=true", "base_num_decoder_layers=4",
        "first_num_dense_layers=1", "vocab_size=1024"]
FP8_FULL = TINY + ["quantization=fp8_full", "quantize_mtp=true"]
QUANTIZED_GROUPS = ("dense stack", "MoE attention", "router", "routed experts wi_0", "routed experts wi_1",
                    "routed experts wo", "shared experts", "MTP block")
INT8_GROUPS = ("dense stack", "MoE attention", "router", "shared experts")



def _docs_table() -> dict:
  """docs/coverage.md's "Matrix units per chip" table: chip -> ({kind: figure as written}, sources cell)."""
  section = DOCS.read_text(encoding="utf-8").split("### Matrix units per chip", 1)[1]
  rows = re.search(r"^\|.*?\n(?!\|)", section, flags=re.M | re.S).group(0).splitlines()
  rows = [line for line in rows if not line.startswith("|---")]
  header = [c.strip() for c in rows[0].strip("|").split("|")]
  out = {}
  for line in rows[1:]:
    cells = [c.strip() for c in line.strip("|").split("|")]
    out[cells[0]] = (dict(zip(header[1:-1], cells[1:-1])), cells[-1])
  return out


def test_the_table_is_the_sourced_table_of_the_docs():
  """Every chip and figure of matrix_units.txt is in docs/coverage.md's table, each row citing a vendor page."""
  docs, table = _docs_table(), matrix_units.chips()
  assert list(docs) == list(table) == ["v4", "v5e", "v5p", "v6e", "tpu7x", "h100", "h200", "b200"]
  for name, chip in table.items():
    figures, sources = docs[name]
    assert {k: v if isinstance(v, str) else f"{v:g}" for k, v in chip.rates.items()} == figures, name
    assert re.search(r"\]\(https://(cloud\.google\.com|www\.nvidia\.com)/", sources), name


@pytest.mark.parametrize("chip, weight, act, unit, ratio, text", [
    ("v5p", "float8_e4m3fn", "float8_e4m3fn", "fp8", 1.0, "fp8 at the bf16 rate (no speed-up)"),
    ("v5p", "int8", "int8", "int8", 2.0, "int8 units, 2x bf16"),
    ("v6e", "int8", "int8", "int8", 2.0, "int8 units, 2x bf16"),
    ("v5e", "float8_e4m3fn", "float8_e4m3fn", "bf16", 1.0, "no fp8 units: bf16 rate (no speed-up)"),
    ("v4", "int8", "int8", "int8", 1.0, "int8 at the bf16 rate (no speed-up)"),
    ("tpu7x", "float8_e4m3fn", "float8_e5m2", "fp8", 2.0, "fp8 units, 2x bf16"),
    ("tpu7x", "int8", "int8", "int8", None, "int8 rate not published"),
    ("h100", "float8_e4m3fn", "float8_e4m3fn", "fp8", 1979 / 989, "fp8 units, 2x bf16"),
    ("b200", "nvfp4", "nvfp4", "fp4", 4.0, "fp4 units, 4x bf16"),
    ("b200", "float4_e2m1fn", "float4_e2m1fn", None, None, "float4_e2m1fn: no published rate"),
    ("v5p", "int8", None, "bf16", 1.0, "int8 weights only: bf16 rate (no speed-up)"),
    ("h100", "int8", "float8_e4m3fn", "bf16", 1.0, "int8 x fp8: widened to bf16 (no speed-up)"),
    ("v5e", "int4", "int4", None, None, "int4: no published rate"),
])
def test_a_type_pair_runs_natively_at_its_rate_or_widened_to_bf16(chip, weight, act, unit, ratio, text):
  speed = matrix_units.speed(matrix_units.chip(chip), weight, act)
  assert (speed.kind, speed.text) == (unit, text)
  assert speed.ratio == (pytest.approx(ratio) if ratio is not None else None)


@pytest.mark.parametrize("chip, in_use, expected", [
    ("v5p", ("float8_e4m3fn", "float8_e4m3fn"),
     "On v5p: fp8 at the bf16 rate (no speed-up): it saves memory, not time. MaxText's quantization=int8 runs at 2x "
     "(918 TOPS vs 459 TFLOPS bf16), on the dense matmuls only"),
    ("v5e", None, "On v5e: no quantization. MaxText's quantization=int8 runs at 2x (393 TOPS vs 197 TFLOPS bf16)"),
    ("tpu7x", ("int8", "int8"), "On tpu7x: int8 rate not published. MaxText's quantization=fp8_full runs at 2x (4614 "
                                "TFLOPS vs 2307 TFLOPS bf16), routed experts (gmm) included"),
    ("h100", None, "On h100: no quantization. MaxText's quantization=fp8_full runs at 2x"),  # a tie: the wider reach
    ("v6e", ("int8", "int8"), "On v6e: int8 units, 2x bf16: the fastest rate v6e publishes for MaxText's modes."),
    ("v4", ("int8", "int8"), "On v4: int8 at the bf16 rate (no speed-up): it saves memory, not time; no type runs "
                             "faster than bf16 on its matrix units."),
])
def test_the_advice_names_the_mode_that_runs_faster_on_the_chip(chip, in_use, expected):
  on = matrix_units.chip(chip)
  assert matrix_units.advice(on, [matrix_units.speed(on, *in_use)] if in_use else []).startswith(expected)


def test_rules_on_v5p_says_fp8_saves_memory_there_and_int8_runs_at_twice_bf16(capsys):
  code, out, _ = run_cli(capsys, "rules", *FP8_FULL, "--chip", "v5p")
  assert code == 0
  lines = out.splitlines()
  block = lines[2:lines.index("Rules:") - 1]
  assert block[0].endswith("gradients; on v5p):") and all(len(line) <= 100 for line in block)
  for name in QUANTIZED_GROUPS:
    row = next(i for i, line in enumerate(block) if line.startswith(f"  {name}  "))
    assert "on v5p: fp8 at the bf16 rate" in " ".join(block[row:row + 2]), name
  assert "on v5p" not in next(line for line in block if line.startswith("  head  "))
  assert "MaxText's quantization=int8 runs at 2x (918 TOPS vs 459 TFLOPS bf16)" in " ".join(block)
  code, same, _ = run_cli(capsys, "rules", *FP8_FULL, "--topology", "v5p-8")
  assert code == 0 and same == out


def test_rules_json_markdown_and_html_carry_the_chip(capsys, tmp_path):
  code, out, _ = run_cli(capsys, "rules", *TINY, "quantization=int8", "--topology", "v5e-8", "--format", "json")
  assert code == 0
  chip = json.loads(out)["summary"]["chip"]
  assert chip["chip"] == "v5e" and chip["advice"].startswith("On v5e: int8 units, 2x bf16: the fastest rate")
  assert [g["name"] for g in chip["groups"]] == list(INT8_GROUPS)
  for group in chip["groups"]:
    assert group["speeds"] == [{"unit": "int8", "rate_vs_bf16": pytest.approx(393 / 197),
                                "text": "int8 units, 2x bf16"}]
  code, out, _ = run_cli(capsys, "rules", *TINY, "quantization=int8", "--chip", "v5e", "--format", "markdown")
  header, rows = _tables(out)[0]
  assert header[-1] == "on v5e" and all(len(r) == len(header) for r in rows)
  assert {r[0]: r[-1] for r in rows if r[-1]} == {name: "int8 units, 2x bf16" for name in INT8_GROUPS}
  code, out, _ = run_cli(capsys, "rules", *TINY, "quantization=int8", "--format", "json")
  assert json.loads(out)["summary"]["chip"] is None
  page = tmp_path / "rules.html"
  code, _, _ = run_cli(capsys, "rules", *TINY, "quantization=int8", "--chip", "v5e", "--html", str(page))
  text = page.read_text(encoding="utf-8")
  assert code == 0 and "<th>on v5e</th>" in text and "On v5e: int8 units, 2x bf16" in text


def test_an_unknown_chip_or_a_disagreeing_topology_is_one_line_exit_2(capsys):
  code, out, err = run_cli(capsys, "rules", *TINY, "--chip", "v9")
  assert code == 2 and not out and len(err.splitlines()) == 1
  assert "unknown chip 'v9'; accepted: v4, v5e, v5p, v6e, tpu7x, h100, h200, b200" in err
  code, _, err = run_cli(capsys, "rules", *TINY, "--chip", "v5e", "--topology", "v5p-8")
  assert code == 2 and "--chip v5e disagrees with --topology v5p-8 (a v5p slice)" in err
  with pytest.raises(errors.InputError, match="unknown chip"):
    matrix_units.chip("H100")


def test_maxtext_summary_on_a_topology_says_how_the_quantization_runs_there(capsys):
  code, out, _ = run_cli(capsys, "maxtext", *TINY, "quantization=int8", "--summary", "--topology", "v5e-8")
  assert code == 0
  lines = out.splitlines()
  start = next(i for i, line in enumerate(lines) if line.startswith("At a glance"))
  block = lines[start:lines.index("", start)]
  assert block[0].endswith("gradients; on v5e):")
  for name in INT8_GROUPS:
    assert next(line for line in block if line.startswith(f"  {name}  ")).endswith("on v5e: int8 units, 2x bf16")
  assert block[-1].startswith("On v5e: int8 units, 2x bf16")
  code, out, _ = run_cli(capsys, "maxtext", *TINY, "--summary", "--chip", "tpu7x")
  assert code == 0 and "At a glance" not in out
  assert "On tpu7x: no quantization. MaxText's quantization=fp8_full runs at 2x (4614 TFLOPS vs 2307 TFLOPS" in out
  code, out, _ = run_cli(capsys, "maxtext", *TINY, "quantization=fp8_full", "--chip", "v5p", "--format", "json")
  data = json.loads(out)
  assert code == 0 and data["chip"]["chip"] == "v5p" and len(data["glance"]) == 9
  assert {g["name"] for g in data["chip"]["groups"]} == set(QUANTIZED_GROUPS) - {"MTP block"}
  code, out, _ = run_cli(capsys, "maxtext", *TINY, "quantization=int8", "--summary")
  assert code == 0 and "At a glance" not in out and "On v" not in out
  code, _, err = run_cli(capsys, "maxtext", *TINY, "quantization=int8", "--chip", "v5e")
  assert code == 2 and "--chip reports with the summary: add --summary" in err
