"""On a TPU chip, commands as processes (marked `tpu`: skipped elsewhere): `make test-tpu` runs this file in a pytest
process of its own before the others, so that the chip is free for each command (one process holds it at a time).

Every command runs on the chip (the int8 export and the training step compiled for the chip's own topology with
MaxText's Megablox kernel among them); the export quantized on the chip stores the bytes of the same export made on
the host's CPU (JAX_PLATFORMS=cpu), and `verify` re-reads both; JAX_DEFAULT_MATMUL_PRECISION=highest runs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.tpu

from conftest import REPO
CKPT = os.path.join(REPO, "tests", "data", "ckpt_deepseek3-tiny-L4-V1024")
TINY = ["model_name=deepseek3-tiny", "mtp_num_layers=1", "override_model_config=true", "base_num_decoder_layers=4",
        "first_num_dense_layers=1", "vocab_size=1024"]


def _tool(*argv, env=None, timeout=600):
  return subprocess.run([sys.executable, "-m", "inspect_tool", *argv], capture_output=True, text=True, cwd=REPO,
                        env=dict(os.environ, **(env or {})), timeout=timeout, check=False)


def test_the_export_on_the_chip_stores_the_cpu_export_s_bytes(tmp_path, record_property):
  """The same export quantized on the chip and on the host's CPU (JAX_PLATFORMS=cpu): every stored tensor's sha256
  and every quantized tensor's error figures (the wall time of each is recorded in the test report)."""
  args = ["export", *TINY, "quantization=fp8_full", "quantize_mtp=true", "--checkpoint", CKPT, "--no-validate"]
  for where, env in (("tpu", {}), ("cpu", {"JAX_PLATFORMS": "cpu"})):
    start = time.perf_counter()
    done = _tool(*args, "--output", str(tmp_path / where), env=env)
    record_property(f"export_seconds_{where}", round(time.perf_counter() - start, 2))
    assert done.returncode == 0, (where, done.stderr[-2000:])
    checked = _tool("verify", str(tmp_path / where))  # the export re-read on the chip's host against its manifest
    assert checked.returncode == 0, (where, checked.stderr[-2000:])
  hashes, errors = {}, {}
  for where in ("tpu", "cpu"):
    with open(tmp_path / where / "export_manifest.json", encoding="utf-8") as f:
      tensors = json.load(f)["tensors"]
    hashes[where] = {t["name"]: t["sha256"] for t in tensors}
    errors[where] = {t["name"]: t["error"] for t in tensors if t.get("error")}
  assert hashes["tpu"] == hashes["cpu"]
  assert errors["cpu"] and errors["tpu"].keys() == errors["cpu"].keys()
  for name, cpu in errors["cpu"].items():  # the chip's figures are of its stored bytes, as the CPU's: the largest
    tpu = errors["tpu"][name]  # error exactly, the mean within float32 summation order
    assert tpu["max_abs"] == cpu["max_abs"] and tpu["elements"] == cpu["elements"], (name, tpu, cpu)
    assert tpu["mean_abs"] == pytest.approx(cpu["mean_abs"], rel=1e-5), (name, tpu, cpu)


@pytest.mark.parametrize("argv", [
    ["forward", *TINY, "--checkpoint", CKPT],
    ["diff", *TINY, "--path", CKPT],
    ["rules", *TINY, "quantization=fp8_full", "quantize_mtp=true"],
    ["maxtext", *TINY, "--summary"],
    ["import", "--path", os.path.join(REPO, "tests", "data", "import", "hf_small"), "--output", "{tmp}/imported"],
    ["export", *TINY, "quantization=fp8_full", "--checkpoint", CKPT, "--output", "{tmp}/ds", "--layout",
     "deepseek-fp8"],
    ["export", *TINY, "quantization=fp8_full", "--checkpoint", CKPT, "--output", "{tmp}/ue", "--layout",
     "deepseek-fp8", "--scale-fmt", "ue8m0", "--no-validate"],
    ["export", *TINY, "quantization=int8", "--checkpoint", CKPT, "--output", "{tmp}/int8"],
    ["maxtext", *TINY, "--topology", "v5e-1", "--train", "adamw", "--compile"],
    ["export", "model_name=deepseek4-tiny", "override_model_config=true", "vocab_size=512", "quantization=fp8_full",
     "--random-init", "--output", "{tmp}/v4", "--layout", "deepseek-v4", "--no-validate"],
], ids=["forward", "diff", "rules", "maxtext", "import", "export-deepseek-fp8", "export-ue8m0", "export-int8",
         "maxtext-compile", "export-deepseek-v4"])
def test_every_command_runs_on_the_chip(argv, tmp_path):
  done = _tool(*[a.replace("{tmp}", str(tmp_path)) for a in argv])
  assert done.returncode == 0, done.stderr[-2000:]


def test_jax_default_matmul_precision_highest_runs_the_fp8_forward():
  done = _tool("forward", *TINY, "quantization=fp8_full", "quantize_mtp=true", "--checkpoint", CKPT,
               env={"JAX_DEFAULT_MATMUL_PRECISION": "highest"})
  assert done.returncode == 0, done.stderr[-2000:]
  assert "main loss" in done.stdout
