"""`inspect_checkpoint import`: a Hugging Face DeepSeek-V3 directory (transformers-made, and the same in DeepSeek's
FP8 release layout) into a MaxText Orbax checkpoint, checked against references that are not ours: MaxText 0.2.5's
own standalone converter's arrays (`data/import/maxtext_converted`, float16), transformers' logits
(`data/import/hf_small_transformers_logits.npz`) and, for the MTP head, a numpy reference of the architecture
(`deepseek_numpy_reference.py`, whose main logits match transformers'); FP8 dequantization against the numpy
reference of the format."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

import deepseek_fp8_reference
import deepseek_numpy_reference
from test_export_distributed import _arrays

from conftest import REPO
from conftest import DATA as DATA_DIR
DATA = os.path.join(DATA_DIR, "import")
HF = os.path.join(DATA, "hf_small")
CONFIG = json.loads(open(os.path.join(HF, "config.json"), encoding="utf-8").read())
_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16, "F8_E4M3": ml_dtypes.float8_e4m3fn,
           "F8_E8M0": ml_dtypes.float8_e8m0fnu, "I8": np.int8, "I32": np.int32}


def _run(*args: str, timeout: int = 300):
  return subprocess.run([sys.executable, "-m", "inspect_tool", *args], capture_output=True, text=True, cwd=REPO,
                        env=dict(os.environ, JAX_PLATFORMS="cpu"), check=False, timeout=timeout)


def read_safetensors(directory: str) -> dict[str, np.ndarray]:
  """Every tensor of a directory's safetensors files, read from the format's definition (8-byte header length,
  JSON header, raw little-endian data)."""
  out = {}
  for name in sorted(os.listdir(directory)):
    if name.endswith(".safetensors"):
      with open(os.path.join(directory, name), "rb") as f:
        header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
        data = f.read()
      for key, entry in header.items():
        if key != "__metadata__":
          begin, end = entry["data_offsets"]
          out[key] = np.frombuffer(data[begin:end], _DTYPES[entry["dtype"]]).reshape(entry["shape"])
  return out


def write_safetensors(path: str, tensors: dict[str, np.ndarray]) -> None:
  """One safetensors file from the format's definition (names sorted, data in that order)."""
  names = {np.dtype(v).name: k for k, v in _DTYPES.items()}
  header, offset = {"__metadata__": {"format": "pt"}}, 0
  for key in sorted(tensors):
    nbytes = tensors[key].nbytes
    header[key] = {"dtype": names[tensors[key].dtype.name], "shape": list(tensors[key].shape),
                   "data_offsets": [offset, offset + nbytes]}
    offset += nbytes
  blob = json.dumps(header).encode()
  blob += b" " * (-len(blob) % 8)
  with open(path, "wb") as f:
    f.write(struct.pack("<Q", len(blob)) + blob)
    for key in sorted(tensors):
      f.write(np.ascontiguousarray(tensors[key]).tobytes())


def _fp8_release(tensors: dict[str, np.ndarray]) -> tuple[dict, dict]:
  """DeepSeek's release layout of float tensors: every Linear weight of a decoder layer as float8_e4m3fn plus its
  128x128 `weight_scale_inv` (the numpy reference); also the exact dequantized values (what import must give)."""
  fp8, dequantized = {}, {}
  for name, value in tensors.items():
    linear = name.startswith("model.layers.") and name.endswith("proj.weight") and ".eh_proj." not in name
    if linear or name.endswith("proj_with_mqa.weight"):
      q, s = deepseek_fp8_reference.block_quantize(value)
      fp8[name], fp8[name[:-len("weight")] + "weight_scale_inv"] = q, s
      dequantized[name] = deepseek_fp8_reference.block_dequantize(q, s)
    else:
      fp8[name] = dequantized[name] = value
  return fp8, dequantized


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
  dst = tmp_path_factory.mktemp("import") / "ckpt"
  out = _run("import", "--path", HF, "--output", str(dst))
  assert out.returncode == 0, out.stderr[-3000:]
  return dst, out


def _keys(dst) -> list[str]:
  return json.loads((dst / "import_report.json").read_text())["maxtext_keys"]


def test_import_writes_maxtexts_own_converter_arrays(imported):
  dst, _ = imported
  ours, theirs = _arrays(str(dst)), _arrays(os.path.join(DATA, "maxtext_converted"))
  assert sorted(ours) == sorted(theirs) and len(ours) == 54  # gate biases, the MTP block and MaxText's `step`
  step = ours.pop("step")
  assert step.dtype == theirs["step"].dtype == np.int64 and step.shape == () and step == theirs.pop("step") == 0
  for name, value in ours.items():
    assert value.dtype == np.float32 and theirs[name].dtype == np.float16, name
    assert np.array_equal(value.astype(np.float16), theirs[name]), name  # MaxText's converter stores float16


def test_forward_of_the_import_reproduces_transformers_and_the_numpy_mtp_reference(imported, tmp_path):
  dst, out = imported
  assert f"--checkpoint {dst}" in out.stdout.splitlines()[-1]  # the command prints the keys to use with DST
  logits = tmp_path / "logits.npz"
  run = _run("forward", *_keys(dst), "dtype=float32", "--checkpoint", str(dst), "--tokens",
             os.path.join(DATA, "tokens.npy"), "--save-logits", str(logits))
  assert run.returncode == 0, run.stderr[-3000:]
  ours = np.load(logits)["logits"].astype(np.float64)
  reference = np.load(os.path.join(DATA, "hf_small_transformers_logits.npz"))["logits"]
  assert np.linalg.norm(ours - reference) / np.linalg.norm(reference) < 1e-6  # measured 3.8e-7
  assert (ours.argmax(-1) == reference.argmax(-1)).all()
  # The MTP head from the release's nextn tensors, by the numpy reference (itself checked against transformers).
  numpy_model = deepseek_numpy_reference.Reference(CONFIG, read_safetensors(HF))
  tokens = np.load(os.path.join(DATA, "tokens.npy"))
  main = numpy_model.main_logits(tokens)
  assert np.linalg.norm(main - reference) / np.linalg.norm(reference) < 1e-6  # measured 3.5e-7
  expected = numpy_model.mtp_logits(tokens)
  mtp = np.load(logits)["mtp_logits"].astype(np.float64).reshape(expected.shape)
  assert np.linalg.norm(mtp - expected) / np.linalg.norm(expected) < 1e-6  # measured 3.8e-7
  assert (mtp.argmax(-1) == expected.argmax(-1)).all()


def test_the_report_records_keys_sources_and_the_mtp_copies(imported):
  dst, _ = imported
  report = json.loads((dst / "import_report.json").read_text())
  keys = dict(key.split("=", 1) for key in report["maxtext_keys"])
  rope = CONFIG["rope_parameters"]
  assert report["source"] == HF and {  # what config.json and the stored tensors say, as MaxText keys
      "base_emb_dim": str(CONFIG["hidden_size"]), "base_num_decoder_layers": str(CONFIG["num_hidden_layers"]),
      "num_experts": str(CONFIG["n_routed_experts"]), "n_routing_groups": str(CONFIG["n_group"]),
      "topk_routing_group": str(CONFIG["topk_group"]), "q_lora_rank": str(CONFIG["q_lora_rank"]),
      "kv_lora_rank": str(CONFIG["kv_lora_rank"]), "routed_scaling_factor": str(CONFIG["routed_scaling_factor"]),
      "rope_factor": str(rope["factor"]), "original_max_position_embeddings": str(
          rope["original_max_position_embeddings"]), "routed_bias": "true", "mtp_num_layers": "1",
      "rope_interleave": "true"}.items() <= keys.items()
  assert report["num_arrays"] == 53 and report["weight_dtype"] == "float32" and report["scan_layers"] is True
  experts = report["arrays"]["params.params.decoder.moe_layers.DeepSeekMoeBlock_0.MoeBlock_0.wi_0"]
  assert experts["shape"] == [8, 2, 128, 64] and experts["source"]["count"] == 16  # 2 layers x 8 experts
  assert experts["source"]["first"] == "model.layers.1.mlp.experts.0.gate_proj.weight"
  assert [(c["name"], c["equal"]) for c in report["mtp_shared_copies"]] == [
      ("model.layers.3.embed_tokens.weight", True), ("model.layers.3.shared_head.head.weight", True)]
  assert report["unused_tensors"] == []


def test_the_fp8_release_layout_is_dequantized_exactly(tmp_path):
  tensors = read_safetensors(HF)
  fp8, dequantized = _fp8_release(tensors)
  assert sum(v.dtype == ml_dtypes.float8_e4m3fn for v in fp8.values()) == 104  # 4 layers x 5 attention, 3 dense, 3 x 27 expert
  for name, values in (("fp8", fp8), ("float", dequantized)):
    os.mkdir(tmp_path / name)
    write_safetensors(str(tmp_path / name / "model.safetensors"), values)
    config = json.loads(open(os.path.join(HF, "config.json"), encoding="utf-8").read())
    if name == "fp8":
      config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
                                       "activation_scheme": "dynamic"}
    (tmp_path / name / "config.json").write_text(json.dumps(config))
    out = _run("import", "--path", str(tmp_path / name), "--output", str(tmp_path / f"{name}.ckpt"))
    assert out.returncode == 0, out.stderr[-3000:]
  from_fp8, from_float = _arrays(str(tmp_path / "fp8.ckpt")), _arrays(str(tmp_path / "float.ckpt"))
  changed = 0
  converted = _arrays(os.path.join(DATA, "maxtext_converted"))
  for name, value in from_fp8.items():
    assert value.tobytes() == from_float[name].tobytes(), name  # value x scale of its block, bit for bit
    changed += not np.array_equal(value.astype(np.float16), converted[name])
  assert changed > 20  # the FP8 values really differ from the float source


def test_mtp_copies_that_differ_and_tensors_no_leaf_reads_are_named(tmp_path):
  tensors = read_safetensors(HF)
  tensors["model.layers.3.shared_head.head.weight"] = tensors["lm_head.weight"] + np.float32(0.5)
  tensors["model.layers.9.extra.weight"] = np.zeros((4,), np.float32)
  os.mkdir(tmp_path / "hf")
  write_safetensors(str(tmp_path / "hf" / "model.safetensors"), tensors)
  shutil.copy(os.path.join(HF, "config.json"), tmp_path / "hf" / "config.json")
  out = _run("import", "--path", str(tmp_path / "hf"), "--output", str(tmp_path / "ckpt"))
  assert out.returncode == 0, out.stderr[-3000:]
  assert "1 tensor(s)" in out.stderr and "model.layers.9.extra.weight" in out.stderr
  assert "model.layers.3.shared_head.head.weight differ" in out.stderr
  report = json.loads((tmp_path / "ckpt" / "import_report.json").read_text())
  head = [c for c in report["mtp_shared_copies"] if c["name"].endswith("shared_head.head.weight")][0]
  assert head["equal"] is False and head["max_abs_diff"] == pytest.approx(0.5)
  assert report["unused_tensors"] == ["model.layers.9.extra.weight"]


def test_refusals_are_one_line_and_leave_nothing(tmp_path):
  dst = tmp_path / "out"
  cases = [
      (["mtp_num_layers=2"], "mtp_num_layers"),  # one MTP layer is stored
      (["base_emb_dim=64"], "base_emb_dim"),  # config.json's hidden_size is 128
      (["model_name=deepseek4-tiny"], ""),
  ]
  for keys, message in cases:
    out = _run("import", *keys, "--path", HF, "--output", str(dst))
    assert out.returncode == 2 and message in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr
  assert not dst.exists() and os.listdir(tmp_path) == []
  dst.mkdir()
  (dst / "mine.txt").write_text("x")
  out = _run("import", "--path", HF, "--output", str(dst))
  assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1 and (dst / "mine.txt").exists()


def test_overwrite_replaces_an_earlier_import_only(imported, tmp_path):
  earlier = tmp_path / "earlier"
  shutil.copytree(imported[0], earlier)
  out = _run("import", "scan_layers=false", "--path", HF, "--output", str(earlier))
  assert out.returncode == 2 and "--overwrite" in out.stderr
  out = _run("import", "scan_layers=false", "--path", HF, "--output", str(earlier), "--overwrite")
  assert out.returncode == 0, out.stderr[-2000:]
  report = json.loads((earlier / "import_report.json").read_text())
  assert report["scan_layers"] is False and "params.params.decoder.moe_layers_1.self_attention.wq_b.kernel" in (
      report["arrays"])
  assert sorted(os.listdir(tmp_path)) == ["earlier"]


def test_import_export_bf16_import_round_trip_gives_the_same_bf16_arrays(imported, tmp_path):
  dst, _ = imported
  out = _run("export", *_keys(dst), "--checkpoint", str(dst), "--layout", "deepseek-bf16", "--output",
             str(tmp_path / "hf"))
  assert out.returncode == 0, out.stderr[-3000:]
  assert "bf16, unquantized" in out.stdout
  written = read_safetensors(str(tmp_path / "hf"))
  assert {v.dtype for k, v in written.items() if not k.endswith("e_score_correction_bias")} == {np.dtype(ml_dtypes.bfloat16)}
  assert not [k for k in written if k.endswith("_scale_inv")]
  assert set(written) == set(read_safetensors(HF))  # the release's names, the MTP layer as layer 3 included
  config = json.loads((tmp_path / "hf" / "config.json").read_text())
  assert "quantization_config" not in config and config["num_nextn_predict_layers"] == 1
  out = _run("import", "--path", str(tmp_path / "hf"), "--output", str(tmp_path / "again"))
  assert out.returncode == 0, out.stderr[-3000:]
  first, again = _arrays(str(dst)), _arrays(str(tmp_path / "again"))
  assert sorted(first) == sorted(again)
  for name, value in first.items():
    expected = value.astype(ml_dtypes.bfloat16).astype(value.dtype) if value.dtype == np.float32 else value
    if name.endswith("gate.bias"):
      expected = value  # the release keeps e_score_correction_bias float32
    assert again[name].tobytes() == expected.tobytes(), name


def test_diff_agrees_with_the_keys_the_import_recorded(imported):
  dst, _ = imported
  keys = json.loads((dst / "import_report.json").read_text())["maxtext_keys"]
  out = _run("diff", *keys, "--path", str(dst))
  assert out.returncode == 0 and "AGREE" in out.stdout, out.stdout[-2000:] + out.stderr[-2000:]


def test_two_processes_import_what_one_process_imports(imported, tmp_path):
  from test_export_distributed import _run_processes  # pylint: disable=import-outside-toplevel

  outs = _run_processes(["import", "--path", HF, "--output", str(tmp_path / "two")])
  for code, _, err in outs:
    assert code == 0, err[-3000:]
  assert outs[0][1].startswith("imported ") and outs[1][1] == ""  # process 0 reports for the job
  one, two = _arrays(str(imported[0])), _arrays(str(tmp_path / "two"))
  assert sorted(one) == sorted(two)
  for name in one:
    assert one[name].tobytes() == two[name].tobytes(), name
  assert sorted(d for d in os.listdir(tmp_path / "two" / "0" / "items") if d.startswith("ocdbt.process_")) == [
      "ocdbt.process_0", "ocdbt.process_1"]


@pytest.mark.slow  # kills a running import: stress (.ci/run: once)
@pytest.mark.parametrize("point", ["start", "written", "report"])
def test_a_killed_import_leaves_no_destination_and_the_next_run_cleans_up(point, tmp_path):
  dst = tmp_path / "dst"
  killed = subprocess.run([sys.executable, "-m", "inspect_tool", "import", "--path", HF, "--output",
                           str(dst), "--quiet"], capture_output=True, text=True, cwd=REPO, check=False, timeout=300,
                          env=dict(os.environ, JAX_PLATFORMS="cpu", INSPECT_EXPORT_KILL_AT=point))
  assert killed.returncode == -9 and not dst.exists()
  out = _run("import", "--path", HF, "--output", str(dst))
  assert out.returncode == 0, out.stderr[-2000:]
  assert os.listdir(tmp_path) == ["dst"] and (dst / "import_report.json").exists()
