"""config.json's rope_scaling read by Hugging Face's YaRN reader gives the rotary embedding and softmax scale MaxText
runs, and the exported files get ordinary permissions.

The reference reader is a numpy transcription of transformers' documented DeepSeek-V3 YaRN semantics
(`modeling_rope_utils` yarn init, `DeepseekV3Attention`'s softmax scale), written for this test: transformers 5.24.0
(MaxText's pin) computes them with torch, which MaxText's stack does not have.
- inverse frequencies: base^(-2i/d) blended with base^(-2i/d)/factor by a linear ramp between the correction dims
  of beta_fast and beta_slow over original_max_position_embeddings (floor/ceil when `truncate`, default true);
- cos and sin are multiplied by `attention_factor`; when absent it is mscale(factor, mscale) / mscale(factor,
  mscale_all_dim) if both are non-zero, else mscale(factor) = 0.1 ln(factor) + 1 (1 for factor <= 1);
- the softmax scale is qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 when mscale_all_dim is non-zero.
"""

import math
import os
import stat

import numpy as np
import pytest

from inspect_tool import model
from inspect_tool.configuration import config
from inspect_tool.paramtree import params
from inspect_tool.fp8_export import write_hf
from inspect_tool.model import rope
from conftest import DATA

TINY = ["model_name=deepseek3-tiny", "mtp_num_layers=0", "override_model_config=true", "base_num_decoder_layers=2",
        "first_num_dense_layers=1", "vocab_size=256"]


def _get_mscale(scale, mscale=1.0):
  return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def hf_yarn(hf):
  """(inverse frequencies, cos/sin factor, softmax scale) as Hugging Face's DeepSeek-V3 reads `hf` (config.json)."""
  rs = hf["rope_scaling"]
  assert rs.get("rope_type", rs.get("type")) == "yarn"
  base, dim = hf["rope_theta"], hf["qk_rope_head_dim"]
  factor, original = rs["factor"], rs["original_max_position_embeddings"]
  mscale, mscale_all_dim = rs.get("mscale"), rs.get("mscale_all_dim")
  attention_factor = rs.get("attention_factor")
  if attention_factor is None:
    if mscale and mscale_all_dim:
      attention_factor = _get_mscale(factor, mscale) / _get_mscale(factor, mscale_all_dim)
    else:
      attention_factor = _get_mscale(factor)
  beta_fast, beta_slow = rs.get("beta_fast") or 32, rs.get("beta_slow") or 1

  def correction_dim(rotations):
    return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

  low, high = correction_dim(beta_fast), correction_dim(beta_slow)
  if rs.get("truncate", True):
    low, high = math.floor(low), math.ceil(high)
  low, high = max(low, 0), min(high, dim - 1)
  if low == high:
    high += 0.001
  ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
  extrapolation = 1 - ramp
  pos_freqs = base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
  inv_freq = (1 / (factor * pos_freqs)) * (1 - extrapolation) + (1 / pos_freqs) * extrapolation
  scale = (hf["qk_nope_head_dim"] + hf["qk_rope_head_dim"]) ** -0.5
  if rs.get("mscale_all_dim"):
    scale *= _get_mscale(factor, rs["mscale_all_dim"]) ** 2
  return inv_freq, attention_factor, scale


CASES = {
    "deepseek3 (context extended)": [],
    "custom, max_position_embeddings <= original": ["max_position_embeddings=4096"],
    "custom, shorter context": ["max_position_embeddings=2048", "original_max_position_embeddings=4096"],
    "deepseek2-style mscale, no truncation": ["mscale=0.707", "rope_truncate=false", "rope_factor=16"],
    "factor 1": ["rope_factor=1", "max_position_embeddings=4096"],
    "rope_attention_scaling": ["rope_attention_scaling=true"],
}


def _maxtext_rotary_gain(cfg):
  """How much our (MaxText's) rotary embedding scales q and k: at position 0 the rotation is the identity."""
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  embedding = rope.YarnRotaryEmbedding(cfg.replace(dtype="float32"))
  x = jnp.arange(1.0, cfg.qk_rope_head_dim + 1.0, dtype=jnp.float32).reshape(1, 1, 1, -1)
  return float(jnp.linalg.norm(embedding(x, jnp.zeros((1, 1), jnp.int32))) / jnp.linalg.norm(x))


@pytest.mark.parametrize("extra", CASES.values(), ids=CASES.keys())
def test_hugging_face_reads_the_rotary_embedding_and_softmax_scale_maxtext_runs(extra):
  cfg = config.resolve_config(TINY + extra)
  hf = write_hf.hf_config(cfg)
  inv_freq, attention_factor, scale = hf_yarn(hf)
  ours = rope.YarnRotaryEmbedding(cfg)
  np.testing.assert_allclose(inv_freq, np.asarray(ours.frequencies(), np.float64), rtol=1e-6)  # float32 powers: measured 6.6e-7
  assert attention_factor == pytest.approx(_maxtext_rotary_gain(cfg), rel=1e-6)
  built = model.build_model(cfg, abstract=True)
  attn_scale = built.decoder.dense_layers.self_attention.softmax_scale
  assert scale == pytest.approx(attn_scale, rel=1e-12) and attn_scale == cfg.softmax_scale


def test_without_an_explicit_attention_factor_hugging_face_would_scale_by_1_369():
  """What the previous config.json of a non-extended model was read as (mscale = mscale_all_dim = 0)."""
  cfg = config.resolve_config(TINY + ["max_position_embeddings=4096"])
  hf = write_hf.hf_config(cfg)
  assert hf["rope_scaling"]["mscale"] == hf["rope_scaling"]["mscale_all_dim"] == 0.0
  del hf["rope_scaling"]["attention_factor"]
  _, attention_factor, _ = hf_yarn(hf)
  assert attention_factor == pytest.approx(0.1 * math.log(40) + 1) == pytest.approx(1.3689, abs=1e-4)


def test_exported_files_have_the_permissions_open_gives(tmp_path):
  cfg = config.resolve_config(TINY)
  leaves = params.param_leaves(model.build_model(cfg, abstract=True), include_non_params=True)
  arrays = {leaf.key: np.ones(leaf.shape, np.float32) for leaf in leaves}
  mask = os.umask(0o022)
  try:
    write_hf.write_deepseek_fp8(arrays, cfg, str(tmp_path), max_shard_bytes=100_000)
  finally:
    os.umask(mask)
  names = sorted(os.listdir(tmp_path))
  assert sum(n.endswith(".safetensors") for n in names) >= 2
  assert {n: stat.S_IMODE(os.stat(tmp_path / n).st_mode) for n in names} == {n: 0o644 for n in names}



# What transformers 5.24.0 (torch 2.13.0) computes from our config.json for each case: made by
# scripts/transformers_rope_reference.py (its docstring says how), in a venv of its own.
TRANSFORMERS_ROPE = os.path.join(DATA, "transformers_rope.json")


def _transformers_cases():
  import json  # pylint: disable=import-outside-toplevel
  with open(TRANSFORMERS_ROPE, encoding="utf-8") as f:
    return json.load(f)


def _rope_of(cfg):
  """(inverse frequencies, q/k gain, softmax scale) the MaxText model of `cfg` runs."""
  built = model.build_model(cfg, abstract=True)
  return (np.asarray(rope.YarnRotaryEmbedding(cfg).frequencies(), np.float64), _maxtext_rotary_gain(cfg),
          built.decoder.dense_layers.self_attention.softmax_scale)


@pytest.mark.parametrize("name", list(_transformers_cases()))
def test_transformers_and_our_reader_read_the_exported_rope_as_the_model_runs_it(name, tmp_path):
  """For every key that enters config.json's rope (max_position_embeddings, rope factor, original length, mscale,
  attention scaling, truncation, theta, betas): transformers 5.24's reading (recorded) and ours (`hf` keys of the
  written directory) both give the rotary embedding and softmax scale of the model the export came from."""
  case = _transformers_cases()[name]
  cfg = config.resolve_config(TINY + case["keys"])
  assert write_hf.hf_config(cfg) == case["config"], "config.json changed: remake tests/data/transformers_rope.json"
  ours = _rope_of(cfg)
  hf = case["transformers"]
  assert hf["version"] == "5.24.0"
  np.testing.assert_allclose(hf["inv_freq"], ours[0], rtol=1e-6)  # torch's float32 powers vs ours
  assert hf["attention_factor"] == pytest.approx(ours[1], rel=1e-6)
  assert hf["softmax_scale"] == pytest.approx(ours[2], rel=1e-12)
  leaves = params.param_leaves(model.build_model(cfg, abstract=True), include_non_params=True)
  write_hf.write_deepseek_fp8({leaf.key: np.ones(leaf.shape, np.float32) for leaf in leaves}, cfg, str(tmp_path))
  from inspect_tool.hf import config as hf_config  # pylint: disable=import-outside-toplevel
  read = config.resolve_config(hf_config.tokens(hf_config.derive_keys(str(tmp_path))))
  back = _rope_of(read)
  np.testing.assert_array_equal(back[0], ours[0])
  assert back[1:] == ours[1:]
  hf_config.check_keys(cfg, str(tmp_path))  # and the export's own keys agree with its config.json
