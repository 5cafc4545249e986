"""`export --layout deepseek-fp8 --max-memory`: under a memory cgroup smaller than the shard it writes and than its
largest tensor (going over kills it), the export completes, and the `safetensors` library reads back the source's
values; a budget below the largest unit of work is one line, exit 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

import deepseek_fp8_reference
import export_sources
import memory_cgroup
from test_export_memory import _arrays

pytestmark = pytest.mark.slow  # memory cgroups: run once, on the primary stack (.ci/run)

from conftest import REPO
LIMIT = 600 * 10**6
# The tied embedding (614400 x 512: 1.26 GB float32, 629 MB bfloat16) dominates: the one shard (5 GB limit) and
# the embedding alone are over LIMIT, so a writer that holds a shard, or converts the embedding whole, is killed.
MODEL = ["model_name=deepseek3-tiny", "override_model_config=true", "mtp_num_layers=0", "base_emb_dim=512",
         "vocab_size=614400", "logits_via_embedding=true", "base_moe_mlp_dim=256", "base_mlp_dim=1024",
         "num_experts=16", "base_num_decoder_layers=3", "first_num_dense_layers=1"]
EMBEDDING = "params.params.token_embedder.embedding"


@pytest.fixture(scope="module")
def source(tmp_path_factory):
  step = tmp_path_factory.mktemp("hfbig") / "0"
  _, largest = export_sources.write_source(str(step), MODEL)
  assert largest >= 2 * LIMIT, largest
  return str(step)


def _export_in(cgroup, source: str, dst: str, *extra: str):
  """The export inside `cgroup` (a `memory_cgroup.Cgroup`): the completed process and its peak RSS in bytes."""
  return memory_cgroup.run_tool(["export", *MODEL, "--layout", "deepseek-fp8", "--no-validate", "--checkpoint", source,
                                 "--output", dst, "--format", "json", *extra], cgroup, timeout=600)


@pytest.mark.skipif(not memory_cgroup.available(), reason="needs a writable memory cgroup v1 hierarchy (root)")
def test_deepseek_fp8_export_streams_a_shard_larger_than_its_memory_cgroup(source, tmp_path):
  import safetensors  # pylint: disable=import-outside-toplevel

  with memory_cgroup.limited(LIMIT, "hf_export_test") as cgroup:
    out, peak = _export_in(cgroup, source, str(tmp_path / "hf"), "--max-memory", "600MB")
  charged = cgroup.charged
  assert out.returncode == 0, out.stderr[-3000:]
  assert 100 * 10**6 < charged <= LIMIT, charged  # the export ran inside the cgroup
  assert peak is not None and peak <= LIMIT, peak  # resident memory (the cgroup also counts page cache)
  summary = json.loads(out.stdout)
  assert summary["max_memory"] == LIMIT and summary["files"] == ["model-00001-of-00001.safetensors"]
  shard = str(tmp_path / "hf" / summary["files"][0])
  assert os.path.getsize(shard) > LIMIT

  src = _arrays(os.path.dirname(source))
  with safetensors.safe_open(shard, framework="np") as f:  # validates the header against the file
    assert f.metadata() == {"format": "pt"} and len(f.keys()) == summary["num_tensors"]
    embedding = f.get_slice("model.embed_tokens.weight")
    assert embedding.get_dtype() == "BF16" and embedding.get_shape() == [614400, 512]
    for start in range(0, 614400, 61440):
      expected = np.asarray(src[EMBEDDING][start:start + 61440].read().result()).astype(ml_dtypes.bfloat16)
      assert embedding[start:start + 61440].tobytes() == expected.tobytes(), start
    bias = f.get_tensor("model.layers.1.mlp.gate.e_score_correction_bias")
  gate_bias = "params.params.decoder.moe_layers.DeepSeekMoeBlock_0.MoeBlock_0.gate.bias"
  np.testing.assert_array_equal(bias, np.asarray(src[gate_bias][0].read().result()))

  # Routed experts (read as raw bytes at the offsets of the header safetensors just validated) against the numpy
  # reference of the 128 x 128 scheme: scales within one ulp, values within one e4m3 step.
  with open(shard, "rb") as f:
    length = int.from_bytes(f.read(8), "little")
    header = json.loads(f.read(length))
  data = np.memmap(shard, np.uint8, mode="r", offset=8 + length)
  wi_0 = src["params.params.decoder.moe_layers.DeepSeekMoeBlock_0.MoeBlock_0.wi_0"]
  for layer, j in ((1, 0), (2, 15)):
    name = f"model.layers.{layer}.mlp.experts.{j}.gate_proj.weight"
    q, s = (np.frombuffer(data[slice(*header[n]["data_offsets"])], dtype).reshape(header[n]["shape"])
            for n, dtype in ((name, ml_dtypes.float8_e4m3fn), (name + "_scale_inv", np.float32)))
    q_ref, s_ref = deepseek_fp8_reference.block_quantize(np.asarray(wi_0[j, layer - 1].read().result()).T)
    assert deepseek_fp8_reference.ulp_distance(s, s_ref).max() <= 1, name
    assert deepseek_fp8_reference.fp8_step_distance(q, q_ref).max() <= 1, name


def test_max_memory_below_the_largest_unit_of_work_is_one_line(tmp_path):
  ckpt = os.path.join(REPO, "tests", "data", "ckpt_deepseek3-tiny-L4-V1024")
  tiny = ["model_name=deepseek3-tiny", "mtp_num_layers=1", "override_model_config=true",
          "base_num_decoder_layers=4", "first_num_dense_layers=1", "vocab_size=1024"]
  out = subprocess.run([sys.executable, "-m", "inspect_tool", "export", *tiny, "--layout", "deepseek-fp8",
                        "--checkpoint", ckpt, "--output", str(tmp_path / "dst"), "--max-memory", "1MB"],
                       capture_output=True, text=True, cwd=REPO, check=False, timeout=300)
  assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr[-2000:]
  assert out.stderr.startswith("error: --max-memory 976.6 KiB is smaller than the smallest slice of ")
  assert "accepted: at least " in out.stderr
  assert os.listdir(tmp_path) == []
