"""DeepSeek-V4 and V3.1 Hugging Face directories, both ways (issue 37), against references that are not ours:
transformers 5.24's logits (`tests/data/v4/logits.npz`, `export_logits.npz`: `scripts/transformers_v4_reference.py`)
on transformers-made directories (its save_pretrained spelling; DeepSeek-V4's release layout with FP4 experts, FP8
rest and ue8m0 scales; V3.1's power-of-two FP8) and on our exports of them, and MaxText 0.2.5's own V4 mapping
(`maxtext_v4_mapping.json`: `scripts/maxtext_v4_mapping_reference.py`). See tests/data/README.md."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from test_export_distributed import _arrays

from conftest import REPO
from conftest import DATA as DATA_DIR
DATA = os.path.join(DATA_DIR, "v4")
SAVED, RELEASE, V31, SAVED_BF16 = (os.path.join(DATA, name) for name in ("v4_saved", "v4_release", "v31_ue8m0",
                                                                         "v4_saved_bf16"))
TOKENS, V3_TOKENS = os.path.join(DATA, "tokens.npy"), os.path.join(REPO, "tests", "data", "import", "tokens.npy")
L4 = ["model_name=deepseek3-tiny", "mtp_num_layers=1", "override_model_config=true", "base_num_decoder_layers=4",
      "first_num_dense_layers=1", "vocab_size=1024"]
L4_CKPT = os.path.join(REPO, "tests", "data", "ckpt_deepseek3-tiny-L4-V1024")
# Our float32 forward against transformers' float32 logits: both compute every op in float32 on the same weights,
# so what is left is summation order (measured 5.5e-7 .. 7.8e-7, every top-1 equal); a wrong transform, scale or
# packing order moves them by 1e-2 or more (the 2-head indexer's tie-breaking alone: 0.14, docs/import.md).
REL = 1e-5


def _run(*args: str, timeout: int = 600):
  return subprocess.run([sys.executable, "-m", "inspect_tool", *args], capture_output=True, text=True, cwd=REPO,
                        env=dict(os.environ, JAX_PLATFORMS="cpu"), check=False, timeout=timeout)


def _keys(path: str) -> list[str]:
  out = _run("hf", "--path", path, "--keys")
  assert out.returncode == 0, out.stderr
  return out.stdout.strip().splitlines()[-1].split()


def _forward(keys, checkpoint, tokens, tmp_path, name) -> np.ndarray:
  logits = tmp_path / f"{name}.npz"
  out = _run("forward", *keys, "dtype=float32", "--checkpoint", str(checkpoint), "--tokens", tokens,
             "--save-logits", str(logits))
  assert out.returncode == 0, out.stderr[-3000:]
  return np.load(logits)["logits"].astype(np.float64)


def _assert_close(ours: np.ndarray, theirs: np.ndarray, bound: float = REL) -> None:
  rel = np.linalg.norm(ours - theirs) / np.linalg.norm(theirs)
  assert rel <= bound, rel
  assert (ours.argmax(-1) == theirs.argmax(-1)).all()


def _import(path, dst, *keys) -> list[str]:
  out = _run("import", "--path", path, "--output", str(dst), *keys)
  assert out.returncode == 0, out.stderr[-3000:]
  return json.loads((dst / "import_report.json").read_text())["maxtext_keys"]


@pytest.fixture(scope="module")
def logits():
  return dict(np.load(os.path.join(DATA, "logits.npz")))


@pytest.fixture(scope="module")
def saved_import(tmp_path_factory):
  dst = tmp_path_factory.mktemp("v4") / "saved"
  return dst, _import(SAVED, dst)


@pytest.fixture(scope="module")
def release_import(tmp_path_factory):
  dst = tmp_path_factory.mktemp("v4") / "release"
  return dst, _import(RELEASE, dst, "mtp_num_layers=0")


def test_both_spellings_give_maxtexts_v4_keys():
  saved, release = (dict(k.split("=", 1) for k in _keys(p)) for p in (SAVED, RELEASE))
  assert saved["model_name"] == release["model_name"] == "deepseek4-284b"
  # transformers' layer_types + compress_rates (HCA at 8: not MaxText's scanned pairs) and mlp_layer_types ...
  assert saved["compress_ratios"] == "[0,4,8,4,8]" and saved["first_num_hash_layers"] == "2"
  assert saved["scan_layers"] == "false"
  # ... and the release's compress_ratios (one more entry: its MTP layer's) and num_hash_layers, scanned.
  assert release["compress_ratios"] == "[0,128,4,128,4]" and release["first_num_hash_layers"] == "1"
  assert "scan_layers" not in release
  for keys in (saved, release):
    assert keys["compressed_rope_max_timescale"] == "40000" and keys["qk_rope_head_dim"] == "16"
    assert keys["indexer_n_heads"] == "16" and keys["mhc_expansion_rate"] == "4" and keys["mtp_num_layers"] == "0"


def test_the_import_is_maxtexts_own_v4_mapping_bit_for_bit(saved_import):
  """MaxText 0.2.5's DEEPSEEK_V4 mapping and hooks on the same tensors: every array, shape and float32 bytes."""
  dst, _ = saved_import
  reference = json.loads(open(os.path.join(DATA, "maxtext_v4_mapping.json"), encoding="utf-8").read())
  ours = _arrays(str(dst))
  assert ours.pop("step") == 0
  expected = {"params.params." + ".".join(key.split("-")[1:]): v for key, v in reference["arrays"].items()}
  assert sorted(ours) == sorted(expected) and len(ours) == 224
  for name, value in ours.items():
    value = np.ascontiguousarray(value, np.float32)
    assert list(value.shape) == expected[name]["shape"], name
    assert hashlib.sha256(value.tobytes()).hexdigest() == expected[name]["sha256"], name
  # MaxText names the attention's kv norm `attn.kv_norm.weight`; the release (and transformers) `attn.norm.weight`.
  assert set(reference["maxtext_name_not_in_release"].values()) == {f"layers.{i}.attn.norm.weight" for i in range(5)}


def test_forward_on_the_import_and_on_the_directory_equals_transformers(saved_import, logits, tmp_path):
  """transformers' save_pretrained, float32 (imported, and read directly) and bfloat16 (read directly)."""
  dst, keys = saved_import
  _assert_close(_forward(keys, dst, TOKENS, tmp_path, "import"), logits["saved"])
  _assert_close(_forward(keys, SAVED, TOKENS, tmp_path, "dir"), logits["saved"])
  assert _keys(SAVED_BF16) == keys
  _assert_close(_forward(keys, SAVED_BF16, TOKENS, tmp_path, "bf16"), logits["saved_bf16"])


def test_the_release_layout_reads_as_transformers_dequantizes_it(release_import, logits, tmp_path):
  """FP4 experts (int8, e8m0 per 32), FP8 with e8m0 128x128 blocks: imported (scanned) and read directly."""
  dst, keys = release_import
  _assert_close(_forward(keys, dst, TOKENS, tmp_path, "import"), logits["release"])
  _assert_close(_forward(keys, RELEASE, TOKENS, tmp_path, "dir"), logits["release"])


def test_the_release_mtp_block_is_refused_or_listed_never_dropped_silently(release_import, tmp_path):
  out = _run("import", "--path", RELEASE, "--output", str(tmp_path / "dst"))
  assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1 and not (tmp_path / "dst").exists()
  assert "stores DeepSeek-V4's MTP block (mtp.0: 5 tensors, e.g. mtp.0.e_proj.weight)" in out.stderr
  assert "does not support MTP layers" in out.stderr and "accepted: mtp_num_layers=0" in out.stderr
  report = json.loads((release_import[0] / "import_report.json").read_text())
  assert report["mtp_not_imported"]["count"] == 5 and "mtp.0.hnorm.weight" in report["mtp_not_imported"]["tensors"]
  assert report["mtp_not_imported"]["tensors"] == [n for n in report["unused_tensors"] if n.startswith("mtp.")]


def test_yarn_on_the_compressed_layers_is_named_as_what_maxtext_does_not_run(logits, tmp_path):
  """DeepSeek-V4-Flash ships rope_scaling (YaRN); MaxText's deepseek4 runs plain RoPE: the import says so (and
  records it), its logits are the ones without YaRN, and transformers' with YaRN differ (measured 0.25)."""
  yarn = tmp_path / "yarn"
  shutil.copytree(RELEASE, yarn)
  shutil.copy(os.path.join(DATA, "config_yarn.json"), yarn / "config.json")
  out = _run("import", "--path", str(yarn), "--output", str(tmp_path / "dst"), "mtp_num_layers=0")
  assert out.returncode == 0, out.stderr
  assert "computes what MaxText does not: rope_scaling: yarn (factor 16)" in out.stderr
  report = json.loads((tmp_path / "dst" / "import_report.json").read_text())
  assert report["not_computed_by_maxtext"][0].startswith("rope_scaling: yarn (factor 16) on the compressed layers")
  ours = _forward(report["maxtext_keys"], tmp_path / "dst", TOKENS, tmp_path, "yarn")
  _assert_close(ours, logits["release"])
  rel = np.linalg.norm(ours - logits["release_yarn"]) / np.linalg.norm(logits["release_yarn"])
  assert rel > 0.1
  diff = _run("diff", *report["maxtext_keys"], "--path", str(yarn)).stdout
  assert "config.json: rope_scaling: yarn (factor 16) on the compressed layers" in diff


def test_summary_and_diff_of_v4_directories(capsys):
  out = _run("hf", "--path", RELEASE, "--summary")
  assert out.returncode == 0, out.stderr
  parts = {m[1]: m[2] for m in (re.match(r"^ {4}(\D+?) {2,}(\S+)", line) for line in out.stdout.splitlines()) if m}
  assert {"mHC mixing", "indexer", "compressors", "hash routing tables", "router", "routed experts",
          "shared experts", "attention and norms"} <= set(parts)
  assert not any(line.startswith("  other") for line in out.stdout.splitlines())
  assert parts["routed experts"] == "491.52K"  # by their FP4 values: 5 layers x 8 experts x 3 x 64 x 64
  for path in (SAVED, RELEASE):
    out = _run("diff", *_keys(path), "--path", path)
    mtp = path == RELEASE
    assert ("DISAGREE: 5 not in model (mtp.0.e_proj.weight" if mtp else "AGREE") in out.stdout, out.stdout[-2000:]
    assert ("DeepSeek-V4's MTP block (5 tensors, e.g. mtp.0.e_proj.weight)" in out.stdout) == mtp


def test_v31_ue8m0_directory_reads_everywhere(logits, tmp_path):
  keys = _keys(V31)
  _assert_close(_forward(keys, V31, V3_TOKENS, tmp_path, "v31"), logits["v31"])
  assert "AGREE" in _run("diff", *keys, "--path", V31).stdout
  dst = tmp_path / "imported"
  _import(V31, dst)
  _assert_close(_forward(keys, dst, V3_TOKENS, tmp_path, "v31_import"), logits["v31"])
  assert "weight_scale_inv" in _run("hf", "--path", V31, "--summary").stdout


def _sha256s(directory) -> dict:
  return {f: hashlib.sha256(open(os.path.join(directory, f), "rb").read()).hexdigest()
          for f in sorted(os.listdir(directory)) if f.endswith((".safetensors", ".json"))
          and f not in ("quantization_report.json", "export_manifest.json")}


def test_the_v4_export_is_what_transformers_ran_and_loads_back(release_import, tmp_path):
  """`export --layout deepseek-v4` of the imported release: the bytes transformers was run on (remake the reference
  when the writer changes), its logits equal ours on the export, and importing it gives the same arrays back."""
  src, keys = release_import
  dst = tmp_path / "export"
  out = _run("export", *keys, "--checkpoint", str(src), "--output", str(dst), "--layout", "deepseek-v4")
  assert out.returncode == 0, out.stderr[-3000:]
  assert _sha256s(dst) == json.loads(open(os.path.join(DATA, "export_sha256.json"), encoding="utf-8").read())["v4"]
  validation = json.loads((dst / "quantization_report.json").read_text())["validation"]  # the fixed 2 x 16 batch
  assert validation["passed"] and validation["vs_quantized_source"][0]["kl"] <= 1e-6
  config = json.loads((dst / "config.json").read_text())
  assert config["expert_dtype"] == "fp4" and config["quantization_config"]["scale_fmt"] == "ue8m0"
  reference = np.load(os.path.join(DATA, "export_logits.npz"))["v4"]
  _assert_close(_forward(keys, dst, TOKENS, tmp_path, "export"), reference)
  again = tmp_path / "again"
  _import(dst, again)
  one, two = _arrays(str(src)), _arrays(str(again))
  assert sorted(one) == sorted(two)
  for name in one:
    assert one[name].tobytes() == two[name].tobytes(), name


def test_the_v31_export_is_what_transformers_ran_and_loads_back(tmp_path):
  dst = tmp_path / "export"
  out = _run("export", *L4, "--checkpoint", L4_CKPT, "--output", str(dst), "--layout", "deepseek-fp8",
             "--scale-fmt", "ue8m0", "--no-validate")
  assert out.returncode == 0, out.stderr[-3000:]
  assert _sha256s(dst) == json.loads(open(os.path.join(DATA, "export_sha256.json"), encoding="utf-8").read())["v31"]
  assert json.loads((dst / "config.json").read_text())["quantization_config"]["scale_fmt"] == "ue8m0"
  reference = np.load(os.path.join(DATA, "export_logits.npz"))["v31"]
  keys = _keys(str(dst))
  _assert_close(_forward(keys, dst, V3_TOKENS, tmp_path, "export"), reference)
  # Import gives the exported values back: exporting that import again and importing it gives the same arrays.
  first = tmp_path / "first"
  _import(str(dst), first)
  out = _run("export", *keys, "--checkpoint", str(first), "--output", str(tmp_path / "again"), "--layout",
             "deepseek-fp8", "--scale-fmt", "ue8m0", "--no-validate")
  assert out.returncode == 0, out.stderr[-3000:]
  second = tmp_path / "second"
  _import(str(tmp_path / "again"), second)
  one, two = _arrays(str(first)), _arrays(str(second))
  assert sorted(one) == sorted(two)
  for name in one:
    assert one[name].tobytes() == two[name].tobytes(), name


def test_a_wrong_fp4_write_fails_the_kl_gate(release_import, tmp_path, capsys, monkeypatch):
  """Every FP4 scale written one power of two too large (e8m0 code + 1): the export read back is far from the
  source under the layout's numerics (measured: cosine 0.64, relative error 0.84), and validation says so (exit 1).
  This random model's logits are nearly flat, so its KL is small (0.0099): the gate is set to 0.001 here, an exact
  write reading back at KL 0."""
  from inspect_tool import cli  # pylint: disable=import-outside-toplevel
  from inspect_tool.fp8_export import hf_matrices  # pylint: disable=import-outside-toplevel

  right = hf_matrices._jitted_fp4_quantize()  # pylint: disable=protected-access
  monkeypatch.setattr(hf_matrices, "_jitted_fp4_quantize",
                      lambda: (lambda w: (lambda packed, codes, error: (packed, codes + 1, error))(*right(w))))
  src, keys = release_import
  dst = tmp_path / "export"
  code = cli.main(["export", *keys, "--checkpoint", str(src), "--output", str(dst), "--layout", "deepseek-v4",
                   "--max-kl", "0.001"])
  out = capsys.readouterr().out
  assert code == 1 and out.rstrip().split("\n")[-1].startswith("FAILED: KL above 0.001 nats ("), out
  rows = json.loads((dst / "quantization_report.json").read_text())["validation"]["vs_quantized_source"]
  assert min(r["kl"] for r in rows) > 0.001 and max(r["rel_error"] for r in rows) > 0.5
