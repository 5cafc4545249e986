"""Listings that read: --filter, --collapse, totals in human units, FP8 scales apart, the fp8 size column.

References are independent of the listing code: MaxText's own listings (tests/data/listings), names and shapes
written into safetensors files here, and the arrays an FP8 export wrote, read back with tensorstore alone.
"""

import json
import math
import os
import re
import struct

import jax
import numpy as np
import pytest
import tensorstore as ts

import maxtext_listings
from inspect_tool.cli import options
from inspect_tool.listings import hf_listing
from inspect_tool.report import listing
from inspect_tool.checkpoint import orbax_metadata
from inspect_tool.fp8_export import pipeline as export

from conftest import DATA
from conftest import run_cli
CKPT = os.path.join(DATA, "ckpt_deepseek3-tiny-L4-V1024")
HF_SMALL = os.path.join(DATA, "import", "hf_small")
L4_SCAN = "deepseek3-tiny-L4-V1024_scan_mtp1.txt"
L4_NOSCAN = "deepseek3-tiny-L4-V1024_noscan_mtp1.txt"
L4 = maxtext_listings.model_keys(L4_SCAN)



def _reference_lines(name):
  return [l for l in (maxtext_listings.LISTINGS / name).read_text().splitlines() if l.startswith("key: ")]


def _size(shape_text):
  return math.prod(int(d) for d in shape_text.replace(" ", "").split(",") if d)


# --filter ------------------------------------------------------------------------------------------------------


def test_filter_lists_maxtexts_matching_lines_and_says_its_total_is_filtered(capsys):
  regex = r"moe_layers.*MoeBlock_0\.wi_"
  code, out, _ = run_cli(capsys, "maxtext", *L4, "--check_dtype", "--filter", regex)
  want = [l for l in _reference_lines(L4_SCAN) if re.search(regex, l.split(" | ")[0][5:])]
  assert code == 0 and len(want) == 2
  lines = out.splitlines()
  assert lines[:-1] == want
  total = sum(_size(re.search(r"shape: \(([\d, ]*)\)", l)[1]) for l in want)
  of = len(_reference_lines(L4_SCAN))
  assert lines[-1].startswith(f"Total shown (filtered by --filter '{regex}': 2 of {of} arrays): {total} = ")
  assert "Total Parameters" not in out  # a filtered total is never printed as the model's


def test_filter_on_orbax_and_hf_and_in_json(capsys):
  regex = r"decoder\.dense_layers\.self_attention"
  code, out, _ = run_cli(capsys, "orbax", "--path", CKPT, "--check_dtype", "--filter", regex)
  want = [l for l in _reference_lines("orbax_ckpt_deepseek3-tiny-L4-V1024.txt") if re.search(regex, l)]
  assert code == 0 and out.splitlines()[:-1] == want and len(want) == 7
  code, out, _ = run_cli(capsys, "hf", "--path", HF_SMALL, "--format", "json", "--filter", r"\.experts\.")
  data = json.loads(out)
  assert code == 0 and data["filter"]["regex"] == r"\.experts\." and data["filter"]["arrays_shown"] == 72
  assert data["total_parameters"] == 3 * 8 * 3 * 64 * 128  # 3 MoE-bearing layers, 8 experts, 3 projections


@pytest.mark.parametrize("regex,message", [("[", "invalid regex"), ("(a+)+$", "backtrack catastrophically"),
                                           ("", "matches every key")])
def test_bad_filter_is_one_line_exit_2(capsys, regex, message):
  for command in (["maxtext", *L4], ["orbax", "--path", CKPT], ["hf", "--path", HF_SMALL]):
    code, out, err = run_cli(capsys, *command, "--filter", regex)
    assert code == 2 and out == "" and message in err and len(err.strip().splitlines()) == 1, (command, err)
    assert "Traceback" not in err


# --collapse ----------------------------------------------------------------------------------------------------


def _expand(key):
  """Every key a collapsed key stands for ('{0..2,5..9 step 2}' ranges), computed here, not by the tool."""
  parts = re.split(r"\{([^}]*)\}", key)
  choices = []
  for i, part in enumerate(parts):
    if i % 2 == 0:
      choices.append([part])
      continue
    values = []
    for item in part.split(","):
      run = re.fullmatch(r"(\d+)\.\.(\d+)(?: step (\d+))?", item)
      values += (list(range(int(run[1]), int(run[2]) + 1, int(run[3] or 1))) if run else [int(item)])
    choices.append([str(v) for v in values])
  out = [""]
  for options in choices:
    out = [prefix + o for prefix in out for o in options]
  return out


_COLLAPSED = re.compile(r"key: (\S+) \| count: (\d+) \| shape each: \(([\d, ]*)\) \| dtype: (\w+) \| total: (.+)$")
_SINGLE = re.compile(r"key: (\S+) \| shape: \(([\d, ]*)\) \| dtype: (\w+)$")


def _entries_of_collapsed(lines):
  """{(key, shape, dtype)} that the collapsed lines stand for; checks each line's count."""
  out = set()
  for line in lines:
    match = _COLLAPSED.match(line)
    if match:
      keys = _expand(match[1])
      assert len(keys) == int(match[2]), line
      shape = tuple(int(d) for d in match[3].replace(" ", "").split(",") if d)
      out |= {(k, shape, match[4]) for k in keys}
    else:
      single = _SINGLE.match(line)
      assert single, line
      out.add((single[1], tuple(int(d) for d in single[2].replace(" ", "").split(",") if d), single[3]))
  return out


@pytest.mark.parametrize("name,most_lines", [(L4_NOSCAN, 51), ("deepseek3-671b_noscan_mtp1.txt", 51)])
def test_collapse_of_an_unscanned_model_stands_for_exactly_maxtexts_lines(capsys, name, most_lines):
  code, out, _ = run_cli(capsys, "maxtext", *maxtext_listings.model_keys(name), "--check_dtype", "--collapse")
  lines = [l for l in out.splitlines() if l.startswith("key: ")]
  assert code == 0 and len(lines) <= most_lines < len(_reference_lines(name))
  assert _entries_of_collapsed(lines) == maxtext_listings.entries(name)
  assert any("moe_layers_{0..57}" in l for l in lines) or "L4" in name


def _handmade_safetensors(path, tensors):
  """A header-only safetensors file (sparse data section) of {name: (tag, shape)}, written without any library."""
  header, offset = {}, 0
  for name, (tag, shape) in tensors.items():
    nbytes = math.prod(shape) * {"F8_E4M3": 1, "BF16": 2, "F32": 4}[tag]
    header[name] = {"dtype": tag, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
    offset += nbytes
  raw = json.dumps(header).encode()
  with open(path, "wb") as f:
    f.write(struct.pack("<Q", len(raw)) + raw)
    f.truncate(8 + len(raw) + offset)


def _v3_like(dense=3, layers=61, experts=256):
  """DeepSeek-V3's tensor names (FP8 release: weight + weight_scale_inv), small shapes: ~90,000 tensors."""
  tensors = {"model.embed_tokens.weight": ("BF16", (16, 8)), "lm_head.weight": ("BF16", (16, 8)),
             "model.norm.weight": ("BF16", (8,))}
  def linear(name, shape):
    tensors[name + ".weight"] = ("F8_E4M3", shape)
    tensors[name + ".weight_scale_inv"] = ("F32", (1, 1))
  for i in range(layers + 1):  # layer `layers` is the MTP layer
    p = f"model.layers.{i}."
    tensors[p + "input_layernorm.weight"] = ("BF16", (8,))
    linear(p + "self_attn.q_a_proj", (4, 8))
    if i < dense:
      linear(p + "mlp.gate_proj", (12, 8))
      continue
    tensors[p + "mlp.gate.weight"] = ("BF16", (experts, 8))
    for j in range(experts):
      for proj, shape in (("gate_proj", (2, 8)), ("up_proj", (2, 8)), ("down_proj", (8, 2))):
        linear(p + f"mlp.experts.{j}.{proj}", shape)
    if i == layers:
      tensors[p + "eh_proj.weight"] = ("BF16", (8, 16))
  return tensors


def test_collapse_makes_a_deepseek_v3_sized_safetensors_listing_short(capsys, tmp_path):
  tensors = _v3_like()
  _handmade_safetensors(str(tmp_path / "model.safetensors"), tensors)
  code, out, _ = run_cli(capsys, "hf", "--path", str(tmp_path), "--check_dtype", "--collapse")
  lines = [l for l in out.splitlines() if l.startswith("key: ")]
  assert code == 0 and len(tensors) > 90_000 and len(lines) <= 20
  tags = {"F8_E4M3": "float8_e4m3fn", "BF16": "bfloat16", "F32": "float32"}
  assert _entries_of_collapsed(lines) == {(n, tuple(s), tags[t]) for n, (t, s) in tensors.items()}
  assert ("key: model.layers.{3..61}.mlp.experts.{0..255}.gate_proj.weight | count: 15104 | shape each: (2, 8) | "
          "dtype: float8_e4m3fn | total: 241.66 K") in lines
  weights = sum(math.prod(s) for n, (_, s) in tensors.items() if not n.endswith("_scale_inv"))
  scales = sum(math.prod(s) for n, (_, s) in tensors.items() if n.endswith("_scale_inv"))
  assert f"Total Parameters: {weights} (~0.00 B)" in out and f" + {scales / 1e3:.2f} K scale values" in out
  report = options.listing_view(hf_listing.hf_listing(str(tmp_path)), collapse=True)  # built once for both formats
  assert listing.format_markdown(report).count("experts.{0..255}") == 6  # gate, up, down: weight, weight_scale_inv
  data = json.loads(listing.format_json(report))
  assert sum(p["count"] for p in data["parameters"]) == len(tensors) and data["total_scales"] == scales


def test_collapse_of_the_small_hf_directory_stands_for_its_tensors(capsys):
  from safetensors import safe_open  # pylint: disable=import-outside-toplevel

  want = set()
  for name in sorted(os.listdir(HF_SMALL)):
    if name.endswith(".safetensors"):
      with safe_open(os.path.join(HF_SMALL, name), "np") as f:
        want |= {(k, tuple(f.get_slice(k).get_shape()), "float32") for k in f.keys()}
  code, out, _ = run_cli(capsys, "hf", "--path", HF_SMALL, "--check_dtype", "--collapse")
  lines = [l for l in out.splitlines() if l.startswith("key: ")]
  assert code == 0 and len(lines) < len(want) and _entries_of_collapsed(lines) == want


# Totals in human units -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("keys,total,human", [
    (L4, 1396848, "1.40 M"), (["model_name=deepseek3-tiny", "mtp_num_layers=1"], 34004896, "34.00 M"),
    (["model_name=deepseek3-671b", "mtp_num_layers=1"], 682636472320, "682.64 B")])
def test_totals_in_human_units_beside_maxtexts_line(capsys, keys, total, human):
  code, out, _ = run_cli(capsys, "maxtext", *keys)
  lines = out.splitlines()
  assert code == 0 and lines[-2] == f"Total Parameters: {total} (~{total / 1e9:.2f} B)"  # MaxText's, as it prints
  assert lines[-1].startswith(f"Total: {human} parameters, ")


# FP8 exports: scales apart; the fp8 column -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def fp8_export(tmp_path_factory):
  dst = str(tmp_path_factory.mktemp("listing_export") / "fp8")
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("devices",))
  export.export(L4 + ["quantization=fp8_full"], dst, source=CKPT, run_validation=False, mesh=mesh,
                command="pytest listing")
  return dst


def _written_arrays(path):
  """{dotted key: numpy array} of every array the export wrote, read with tensorstore alone."""
  listing = orbax_metadata.read_listing(path)
  items = os.path.abspath(listing.resolved.items_dir)
  out = {}
  for key, raw in listing.raw_keys.items():
    spec = {"driver": "zarr3", "kvstore": {"driver": "ocdbt", "base": f"file://{items}/"},
            "path": ".".join(map(str, raw)) + "/"}
    out[".".join(key)] = np.asarray(ts.open(spec).result().read().result())
  return out


def test_an_export_counts_its_scales_apart_from_its_parameters(capsys, fp8_export):
  arrays = _written_arrays(fp8_export)
  scales = sum(a.size for k, a in arrays.items() if k.endswith(".array.scale"))
  source = sum(math.prod(s) for k, s, _ in maxtext_listings.entries("orbax_ckpt_deepseek3-tiny-L4-V1024.txt")
               if k.startswith("params.params."))
  assert scales > 0 and sum(a.size for a in arrays.values()) == source + scales
  code, out, err = run_cli(capsys, "orbax", "--path", fp8_export)
  assert code == 0 and "an FP8 export" in err
  assert f"Total Parameters: {source} (~0.00 B)" in out  # the source's parameters, as MaxText lists the source
  assert f"Total: {source / 1e6:.2f} M parameters + {scales / 1e3:.2f} K scale values" in out
  data = json.loads(run_cli(capsys, "orbax", "--path", fp8_export, "--format", "json")[1])
  assert (data["total_parameters"], data["total_scales"]) == (source, scales)


def test_fp8_column_is_what_export_writes(capsys, fp8_export):
  """The model's fp8 bytes = the bytes the export wrote (minus the gate bias, not a Param of the model)."""
  arrays = _written_arrays(fp8_export)
  written = sum(a.nbytes for k, a in arrays.items() if not k.endswith("gate.bias"))
  data = json.loads(run_cli(capsys, "maxtext", *L4, "quantization=fp8_full", "--format", "json")[1])
  assert data["summary"]["total_bytes_fp8"] == written
  groups = {(g["group"], g["part"]): g for g in data["summary"]["groups"]}
  # routed experts: wi_0, wi_1, wo of (16 experts, 3 layers, 64, 64) at 1 byte + bf16 scales (1, 3, 1, 64)
  assert groups[("moe stack", "routed experts")]["bytes_fp8"] == 3 * (16 * 3 * 64 * 64 + 2 * 3 * 64)
  mtp = groups[("mtp block", "")]  # quantize_mtp=false: never quantized, stays float32
  assert mtp["bytes_fp8"] == mtp["bytes"] == 4 * mtp["params"]
  # unquantized config: MaxText's fp8_full rules, the same figures; the text says which rules decided
  code, out, _ = run_cli(capsys, "maxtext", *L4, "--summary")
  assert code == 0 and "fp8: quantization=fp8_full rules: the 20 weights they quantize" in out
  total_row = next(l for l in out.splitlines() if l.strip().startswith("total "))
  assert total_row.split()[-1] == "MiB" and f"{written / 2**20:.2f}" in total_row
  code, out, _ = run_cli(capsys, "orbax", "--path", CKPT, "--summary")  # a float checkpoint without rules: unknown
  assert code == 0 and "fp8: unknown here" in out


def test_diff_filter_lists_only_matching_differences_and_keeps_the_whole_verdict(capsys):
  argv = ["diff", "model_name=deepseek3-tiny", "mtp_num_layers=1", "--path", CKPT]
  code, full, _ = run_cli(capsys, *argv)
  rows = [l.strip() for l in full.splitlines() if l.startswith("  ") and " vs checkpoint " in l]  # shape mismatches
  regex = r"self_attention\.w"
  code_f, out, _ = run_cli(capsys, *argv, "--filter", regex)
  want = [r for r in rows if re.search(regex, r.split(":")[0])]
  got = [l.strip() for l in out.splitlines() if l.startswith("  ") and " vs checkpoint " in l]
  assert code == code_f == 1 and 0 < len(want) < len(rows) and got == want
  assert f"shown: the {len(want)} of {len(rows)} differences whose key matches --filter '{regex}'" in out
  assert out.splitlines()[-1] == full.splitlines()[-1]  # the verdict: the whole model's
  data = json.loads(run_cli(capsys, *argv, "--filter", regex, "--format", "json")[1])
  assert data["agree"] is False and len(data["shape_mismatches"]) == len(want)
  code, out, err = run_cli(capsys, *argv, "--filter", "(")
  assert code == 2 and out == "" and len(err.strip().splitlines()) == 1


def test_filter_takes_slash_paths_as_rules_writes_them(capsys):
  dotted = run_cli(capsys, "maxtext", *L4, "--filter", r"mtp_block\.mtp_layer_1\.mtp_1_transformer_layer\.self_attention")[1]
  slashed = run_cli(capsys, "maxtext", *L4, "--filter", "mtp_block/mtp_layer_1/mtp_1_transformer_layer/self_attention")[1]
  want = [l.split(" | dtype")[0] for l in _reference_lines(L4_SCAN)
          if ".mtp_1_transformer_layer.self_attention." in l]
  assert dotted.splitlines()[:-1] == slashed.splitlines()[:-1] == want and len(want) == 7


def test_a_filtered_listing_never_judges_device_memory(capsys):
  code, out, err = run_cli(capsys, "maxtext", *L4, "--devices", "4", "--device-memory", "1GB", "--filter", "wi_0")
  assert code == 2 and out == "" and "--device-memory" in err and len(err.strip().splitlines()) == 1
