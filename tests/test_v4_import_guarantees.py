"""The V3 import's guarantees on DeepSeek-V4 directories (issue 37, item 6): `--max-memory` refusals naming the
floor and the floor's import writing the unbounded bytes, two processes writing what one writes, gs:// in and out,
and one line (exit 2, nothing written) for a directory whose config.json and tensors disagree."""

from __future__ import annotations

import json
import os
import re
import shutil
import struct

import pytest

from gcs_emulator import BUCKET
from test_export_distributed import _arrays, _run_processes
from test_v4_hf import RELEASE, SAVED, _run


def _one_line(out, *expected: str) -> str:
  lines = out.stderr.strip().splitlines()
  assert out.returncode == 2 and len(lines) == 1, out.stderr[-3000:]
  for text in expected:
    assert text in lines[0], lines[0]
  return lines[0]


def _same_arrays(a: str, b: str) -> None:
  one, two = _arrays(a), _arrays(b)
  assert sorted(one) == sorted(two)
  for name in one:
    assert one[name].tobytes() == two[name].tobytes(), name


@pytest.fixture(scope="module")
def unbounded(tmp_path_factory):
  dst = tmp_path_factory.mktemp("v4g") / "unbounded"
  out = _run("import", "--path", RELEASE, "--output", str(dst), "mtp_num_layers=0")
  assert out.returncode == 0, out.stderr[-3000:]
  return str(dst)


def test_a_budget_is_refused_in_one_line_or_kept_with_the_unbounded_bytes(unbounded, tmp_path):
  """(The floor of the smallest read and peak RSS in a memory cgroup: tests/test_v4_import_memory.py, slow.)"""
  line = _one_line(_run("import", "--path", RELEASE, "--output", str(tmp_path / "small"), "mtp_num_layers=0",
                        "--max-memory", "1MB"), "--max-memory 976.6 KiB is not above the")
  assert not (tmp_path / "small").exists()
  assert re.search(r"accepted: more than [0-9.]+ MiB$", line)
  out = _run("import", "--path", RELEASE, "--output", str(tmp_path / "bounded"), "mtp_num_layers=0", "--max-memory",
             "600MB")
  assert out.returncode == 0, out.stderr[-3000:]
  _same_arrays(unbounded, str(tmp_path / "bounded"))


def test_two_processes_import_what_one_process_imports(unbounded, tmp_path):
  outs = _run_processes(["import", "--path", RELEASE, "--output", str(tmp_path / "two"), "mtp_num_layers=0"])
  for code, _, err in outs:
    assert code == 0, err[-3000:]
  _same_arrays(unbounded, str(tmp_path / "two"))


def test_gs_in_and_out_equals_the_local_import(unbounded, gcs, tmp_path):
  source = gcs.upload(RELEASE, f"gs://{BUCKET}/v4/release")
  remote = f"gs://{BUCKET}/v4/imported"
  out = _run("import", "--path", source, "--output", remote, "mtp_num_layers=0")
  assert out.returncode == 0, out.stderr[-3000:]
  _same_arrays(unbounded, remote)


def test_a_v4_export_to_gs_equals_the_local_one(unbounded, gcs, tmp_path):
  from inspect_tool.storage import objects  # pylint: disable=import-outside-toplevel

  keys = json.loads(open(os.path.join(unbounded, "import_report.json"), encoding="utf-8").read())["maxtext_keys"]
  local, remote = tmp_path / "local", f"gs://{BUCKET}/v4/export"
  for dst in (str(local), remote):
    out = _run("export", *keys, "--checkpoint", unbounded, "--output", dst, "--layout", "deepseek-v4", "--no-validate")
    assert out.returncode == 0, out.stderr[-3000:]
  for name in os.listdir(local):
    if name.endswith((".safetensors", "config.json", ".index.json")):
      assert objects.read(f"{remote}/{name}")[0] == (local / name).read_bytes(), name


def _edited(tmp_path, source: str, edit_config=None) -> str:
  """A copy of `source` with its config.json edited."""
  target = tmp_path / "edited"
  shutil.copytree(source, target)
  if edit_config:
    config = json.loads((target / "config.json").read_text())
    edit_config(config)
    (target / "config.json").write_text(json.dumps(config))
  return str(target)


@pytest.mark.parametrize("edit, expected", [
    (lambda c: c.pop("expert_dtype"), "is packed FP4 (I8 beside an e8m0 scale) but"),
    (lambda c: c["quantization_config"].pop("scale_fmt"), "holds float8_e8m0fnu scales but"),
    (lambda c: c.update(hidden_size=128), "does not fit the model: "),
    (lambda c: c.update(compress_ratios=[0, 4, 128, 128, 4, 0]), "does not fit the model: "),
    (lambda c: c.update(hc_eps=1e-5), "hc_eps=1e-05 cannot be expressed in MaxText"),
    (lambda c: c.update(num_key_value_heads=4), "num_key_value_heads=4 cannot be expressed"),
])
def test_config_and_tensors_that_disagree_are_one_line_and_nothing_is_written(edit, expected, tmp_path):
  path = _edited(tmp_path, RELEASE, edit)
  _one_line(_run("import", "--path", path, "--output", str(tmp_path / "dst"), "mtp_num_layers=0"), expected)
  assert not (tmp_path / "dst").exists()


def test_transformers_spelled_schedules_maxtext_cannot_run_are_one_line(tmp_path):
  cases = [({"layer_types": ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                             "compressed_sparse_attention", "heavily_compressed_attention"],
             "compress_rates": {"compressed_sparse_attention": 8, "heavily_compressed_attention": 8}},
            "compressed sparse attention at ratio 8 (layer 1) cannot be expressed in MaxText"),
           ({"mlp_layer_types": ["moe", "hash_moe", "moe", "moe", "moe"]},
            "its hash-routed layers are the first ones")]
  for update, expected in cases:
    path = _edited(tmp_path / str(len(expected)), SAVED, lambda c, u=update: c.update(u))
    _one_line(_run("hf", "--path", path, "--keys"), expected)


def test_a_scale_that_is_not_a_power_of_two_under_ue8m0_is_one_line(tmp_path):
  """V3.1's directory says scale_fmt ue8m0; one float32 weight_scale_inv made 1.5 times a power of two."""
  from test_v4_hf import V31  # pylint: disable=import-outside-toplevel

  path = _edited(tmp_path, V31)
  index = json.loads(open(os.path.join(path, "model.safetensors.index.json"), encoding="utf-8").read())["weight_map"]
  name = "model.layers.1.self_attn.q_b_proj.weight_scale_inv"
  shard = os.path.join(path, index[name])
  with open(shard, "r+b") as f:
    length = struct.unpack("<Q", f.read(8))[0]
    entry = json.loads(f.read(length))[name]
    f.seek(8 + length + entry["data_offsets"][0])
    value = struct.unpack("<f", f.read(4))[0]
    f.seek(8 + length + entry["data_offsets"][0])
    f.write(struct.pack("<f", value * 1.5))
  keys = [k for k in _run("hf", "--path", V31, "--keys").stdout.split() if "=" in k]
  _one_line(_run("import", "--path", path, "--output", str(tmp_path / "dst"), *keys),
            f"tensor '{name}' holds 1 scale(s) that are not powers of two", "says scale_fmt ue8m0")
  assert not (tmp_path / "dst").exists()
