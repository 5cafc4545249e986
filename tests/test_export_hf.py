"""Tests for inspect_tool.fp8_export.write_hf: MaxText → Hugging Face DeepSeek FP8 (128×128 block scales) export."""

import json
import math
import os

import ml_dtypes
import numpy as np
import pytest

from inspect_tool import errors, model
from inspect_tool.configuration import config
from inspect_tool.paramtree import params
from inspect_tool.paramtree import tree
from inspect_tool.fp8_export import hf_matrices
from inspect_tool.fp8_export import write_hf as export_hf
from inspect_tool.hf import safetensors_header

import deepseek_fp8_reference
import maxtext_listings

TINY = ["model_name=deepseek3-tiny", "mtp_num_layers=1", "override_model_config=true",
        "base_num_decoder_layers=4", "first_num_dense_layers=1", "vocab_size=1024"]
# Dims that are not multiples of 128 (and > 128) plus DeepSeek-V2's q_proj / no-bias softmax routing.
V2_LIKE = ["model_name=deepseek2-16b", "override_model_config=true", "base_emb_dim=160", "base_num_query_heads=2",
           "base_num_kv_heads=2", "base_mlp_dim=136", "base_moe_mlp_dim=72", "num_experts=4",
           "num_experts_per_tok=2", "base_num_decoder_layers=3", "first_num_dense_layers=1", "vocab_size=300",
           "kv_lora_rank=144", "qk_nope_head_dim=32", "qk_rope_head_dim=16", "v_head_dim=24"]
TINY_WORK_BYTES, TINY_HEADER_RESERVE = 300_000, 4096
NP_DTYPES = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "BF16": ml_dtypes.bfloat16, "F32": np.float32}


def _random_arrays(cfg, seed=0):
  leaves = params.param_leaves(model.build_model(cfg, abstract=True), include_non_params=True)
  rng = np.random.default_rng(seed)
  return {leaf.key: rng.standard_normal(leaf.shape, dtype=np.float32) for leaf in leaves}


def _export(tmp_path_factory, cfg, arrays, **kw):
  out = str(tmp_path_factory.mktemp("hf"))
  summary = export_hf.write_deepseek_fp8(arrays, cfg, out, **kw)
  return out, summary


def _read_tensors(directory):
  """name -> numpy array of every shard, read by the `safetensors` library (it validates header and offsets)."""
  import safetensors  # pylint: disable=import-outside-toplevel

  tensors = {}
  for name in sorted(os.listdir(directory)):
    if not name.endswith(".safetensors"):
      continue
    path = os.path.join(directory, name)
    with safetensors.safe_open(path, framework="np") as f:
      assert f.metadata() == {"format": "pt"}
    with open(path, "rb") as f:
      for tensor, entry in safetensors.deserialize(f.read()):
        tensors[tensor] = np.frombuffer(entry["data"], NP_DTYPES[entry["dtype"]]).reshape(entry["shape"])
  return tensors


def _dequantize(q, scale_inv):
  full = np.repeat(np.repeat(scale_inv, 128, axis=0), 128, axis=1)[:q.shape[0], :q.shape[1]]
  return q.astype(np.float32) * full


def _bf16(x):
  return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16)


# Test-side reference: the HF (out, in) matrix of a Linear is the Jacobian of MaxText's own contraction.
# hf suffix -> (MaxText subpath under the layer, einsum of one input vector with the per-layer kernel).
ATTENTION = {
    "self_attn.q_a_proj": (("self_attention", "wq_a", "kernel"), "e,er->r"),
    "self_attn.q_b_proj": (("self_attention", "wq_b", "kernel"), "r,rhd->hd"),
    "self_attn.q_proj": (("self_attention", "query", "kernel"), "e,ehd->hd"),
    "self_attn.kv_a_proj_with_mqa": (("self_attention", "wkv_a", "kernel"), "e,ec->c"),
    "self_attn.kv_b_proj": (("self_attention", "wkv_b", "kernel"), "r,rhd->hd"),
    "self_attn.o_proj": (("self_attention", "out", "kernel"), "hd,hde->e"),
}
DENSE = {f"mlp.{hf}": (("mlp", mt, "kernel"), spec) for hf, mt, spec in
         (("gate_proj", "wi_0", "e,ef->f"), ("up_proj", "wi_1", "e,ef->f"), ("down_proj", "wo", "f,fe->e"))}
SHARED = {f"mlp.shared_experts.{hf}": (("DeepSeekMoeBlock_0", "shared_experts", mt, "kernel"), spec)
          for hf, mt, spec in (("gate_proj", "wi_0", "e,ef->f"), ("up_proj", "wi_1", "e,ef->f"),
                               ("down_proj", "wo", "f,fe->e"))}
EXPERTS = {hf: (("DeepSeekMoeBlock_0", "MoeBlock_0", mt), spec) for hf, mt, spec in
           (("gate_proj", "wi_0", "e,ef->f"), ("up_proj", "wi_1", "e,ef->f"), ("down_proj", "wo", "f,fe->e"))}


def _layer_kernel(arrays, cfg, hf_layer, sub):
  """Per-layer MaxText array of HF layer `hf_layer` (scanned: layer axis param_scan_axis)."""
  d, big_l = cfg.first_num_dense_layers, cfg.num_decoder_layers
  if hf_layer >= big_l:
    k = hf_layer - big_l + 1
    return arrays[tree.param_key(("mtp_block", f"mtp_layer_{k}", f"mtp_{k}_transformer_layer") + sub)]
  stack, index = ("dense_layers", hf_layer) if hf_layer < d else ("moe_layers", hf_layer - d)
  if not cfg.scan_layers:
    return arrays[tree.param_key(("decoder", f"{stack}_{index}") + sub)]
  return np.take(arrays[tree.param_key(("decoder", stack) + sub)], index, axis=cfg.param_scan_axis)


def _jacobian(spec, kernel):
  inputs, out = spec.split("->")
  x_spec, k_spec = inputs.split(",")
  in_shape = kernel.shape[:len(x_spec)]
  n_in = math.prod(in_shape)
  y = np.einsum(f"z{x_spec},{k_spec}->z{out}", np.eye(n_in, dtype=np.float32).reshape((n_in,) + in_shape), kernel)
  return y.reshape(n_in, -1).T


def _reference_fp8(cfg, arrays):
  """HF name -> float32 (out, in) matrix for every FP8 tensor the export should hold."""
  refs = {}
  for i in range(cfg.num_decoder_layers + cfg.mtp_num_layers):
    moe = i >= cfg.first_num_dense_layers
    table = dict(ATTENTION, **(SHARED if moe else DENSE))
    for hf, (sub, spec) in table.items():
      if hf == "self_attn.q_proj" and cfg.q_lora_rank or hf in ("self_attn.q_a_proj", "self_attn.q_b_proj") \
          and not cfg.q_lora_rank:
        continue
      refs[f"model.layers.{i}.{hf}.weight"] = _jacobian(spec, _layer_kernel(arrays, cfg, i, sub))
    if moe:
      for hf, (sub, spec) in EXPERTS.items():
        stacked = _layer_kernel(arrays, cfg, i, sub)
        for j in range(cfg.num_experts):
          refs[f"model.layers.{i}.mlp.experts.{j}.{hf}.weight"] = _jacobian(spec, stacked[j])
  return refs


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  cfg = config.resolve_config(TINY)
  arrays = _random_arrays(cfg)
  # A small memory for work and header reserve: FP8 leaves read in blocks of one expert (every layer) or of
  # one layer, the embedding and head by 146-row blocks, shards also closed when 4 KiB of header are full.
  out, summary = _export(tmp_path_factory, cfg, arrays, max_shard_bytes=300_000, work_bytes=TINY_WORK_BYTES,
                         header_reserve=TINY_HEADER_RESERVE)
  return cfg, arrays, out, summary, _read_tensors(out)


@pytest.fixture(scope="module")
def v2_like(tmp_path_factory):
  cfg = config.resolve_config(V2_LIKE)
  arrays = _random_arrays(cfg, seed=1)
  out, summary = _export(tmp_path_factory, cfg, arrays)
  return cfg, arrays, out, summary, _read_tensors(out)


@pytest.mark.parametrize("listing", [
    "deepseek3-tiny-L4-V1024_scan_mtp1.txt", "deepseek3-tiny-L4-V1024_noscan_mtp1.txt",
    "deepseek3-tiny-L4-V1024-scanaxis0_scan_mtp1.txt", "deepseek2-16b-small_scan_mtp0.txt",
    "deepseek3-tiny-L4-V1024-dense0_scan_mtp2.txt"])
def test_source_shapes_are_maxtexts_listing_plus_the_gate_bias(listing):
  """Params against MaxText's listing of the same keys; the gate bias (not a Param, so not in MaxText's listing)
  against the model."""
  cfg = config.resolve_config(maxtext_listings.model_keys(listing))
  shapes = export_hf.source_shapes(cfg)
  assert {".".join(k): v for k, v in shapes.items() if k[:2] == tree.PARAMS_PREFIX} == {
      key: shape for key, shape, _ in maxtext_listings.entries(listing)}
  leaves = params.param_leaves(model.build_model(cfg, abstract=True), include_non_params=True)
  assert {k: v for k, v in shapes.items() if k[:2] != tree.PARAMS_PREFIX} == {
      leaf.key: leaf.shape for leaf in leaves if not leaf.is_param}


def test_the_small_v2_config_is_the_one_maxtext_listed():
  assert maxtext_listings.model_keys("deepseek2-16b-small_scan_mtp0.txt") == (
      V2_LIKE[:1] + ["scan_layers=true"] + V2_LIKE[1:])
  assert maxtext_listings.model_keys("deepseek3-tiny-L4-V1024_scan_mtp1.txt") == TINY


def _expected_listing(cfg):
  """HF name -> (shape, dtype) written independently of the module's tables (DeepSeek-V3 release layout)."""
  e, h, v, x, fm = cfg.emb_dim, cfg.num_query_heads, cfg.vocab_size, cfg.num_experts, cfg.moe_mlp_dim
  dn, dr, dv, qr, kr = (cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.q_lora_rank,
                        cfg.kv_lora_rank)
  bf16, f8 = "bfloat16", "float8_e4m3fn"
  out = {"model.embed_tokens.weight": ((v, e), bf16), "model.norm.weight": ((e,), bf16),
         "lm_head.weight": ((v, e), bf16)}

  def linear(name, o, i):
    out[name + ".weight"] = ((o, i), f8)
    out[name + ".weight_scale_inv"] = ((math.ceil(o / 128), math.ceil(i / 128)), "float32")

  big_l = cfg.num_decoder_layers
  for i in range(big_l + cfg.mtp_num_layers):
    p = f"model.layers.{i}."
    out[p + "input_layernorm.weight"] = ((e,), bf16)
    out[p + "post_attention_layernorm.weight"] = ((e,), bf16)
    if qr:
      linear(p + "self_attn.q_a_proj", qr, e)
      out[p + "self_attn.q_a_layernorm.weight"] = ((qr,), bf16)
      linear(p + "self_attn.q_b_proj", h * (dn + dr), qr)
    else:
      linear(p + "self_attn.q_proj", h * (dn + dr), e)
    linear(p + "self_attn.kv_a_proj_with_mqa", kr + dr, e)
    out[p + "self_attn.kv_a_layernorm.weight"] = ((kr,), bf16)
    linear(p + "self_attn.kv_b_proj", h * (dn + dv), kr)
    linear(p + "self_attn.o_proj", e, h * dv)
    if i < cfg.first_num_dense_layers:
      for proj, (o, n) in (("gate_proj", (cfg.mlp_dim, e)), ("up_proj", (cfg.mlp_dim, e)),
                           ("down_proj", (e, cfg.mlp_dim))):
        linear(p + "mlp." + proj, o, n)
      continue
    out[p + "mlp.gate.weight"] = ((x, e), bf16)
    if cfg.routed_bias:
      out[p + "mlp.gate.e_score_correction_bias"] = ((x,), "float32")
    s = cfg.shared_experts * fm
    for proj, (o, n), (so, sn) in (("gate_proj", (fm, e), (s, e)), ("up_proj", (fm, e), (s, e)),
                                   ("down_proj", (e, fm), (e, s))):
      linear(p + "mlp.shared_experts." + proj, so, sn)
      for j in range(x):
        linear(p + f"mlp.experts.{j}." + proj, o, n)
    if i >= big_l:
      for name, shape in (("enorm", (e,)), ("hnorm", (e,)), ("shared_head.norm", (e,)),
                          ("eh_proj", (e, 2 * e)), ("embed_tokens", (v, e)), ("shared_head.head", (v, e))):
        out[p + name + ".weight"] = (shape, bf16)
  return out


@pytest.mark.parametrize("which", ["tiny", "v2_like"])
def test_header_reader_lists_release_names_shapes_and_dtypes(which, request):
  cfg, _, out, _, _ = request.getfixturevalue(which)
  listed = {leaf.dotted: (leaf.shape, leaf.dtype) for leaf in safetensors_header.read_leaves(out)}
  assert listed == _expected_listing(cfg)


def test_index_maps_every_tensor_to_its_shard_and_shards_respect_the_size_limit(tiny):
  _, _, out, summary, tensors = tiny
  with open(os.path.join(out, export_hf.INDEX_NAME)) as f:
    index = json.load(f)
  assert set(index["weight_map"]) == set(tensors)
  n = len(summary.files)
  assert n > 1 and summary.files == [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)]
  assert sorted(os.listdir(out)) == sorted(summary.files + [export_hf.INDEX_NAME, "config.json"])
  assert index["metadata"]["total_size"] == summary.total_size == sum(t.nbytes for t in tensors.values())
  for shard in summary.files:
    names = [k for k, s in index["weight_map"].items() if s == shard]
    assert set(names) == set(safetensors_header.read_header(os.path.join(out, shard)))
    size = sum(tensors[k].nbytes for k in names)
    assert size <= 300_000 or len(names) == 1
  assert summary.num_tensors == len(tensors)
  assert summary.num_fp8 == sum(k.endswith("_scale_inv") for k in tensors)


@pytest.mark.parametrize("which", ["tiny", "v2_like"])
def test_fp8_weights_are_the_block_quantized_maxtext_contraction(which, request):
  cfg, arrays, _, _, tensors = request.getfixturevalue(which)
  refs = _reference_fp8(cfg, arrays)
  assert set(refs) == {k[:-len("_scale_inv")] for k in tensors if k.endswith("_scale_inv")}
  differing = 0
  for name, w_ref in refs.items():
    q, scale_inv = tensors[name], tensors[name + "_scale_inv"]
    assert q.dtype == ml_dtypes.float8_e4m3fn and scale_inv.dtype == np.float32
    # Against the numpy reference of DeepSeek's 128 x 128 scheme applied to the reference matrix.
    q_ref, s_ref = deepseek_fp8_reference.block_quantize(w_ref)
    assert deepseek_fp8_reference.ulp_distance(scale_inv, s_ref).max() <= 1, name
    steps = deepseek_fp8_reference.fp8_step_distance(q, q_ref)
    assert steps.max() <= 1, name
    differing += int(np.count_nonzero(steps))
    # Round trip: within e4m3's half-ulp (2^-4 relative) plus half its smallest subnormal step per block.
    full = np.repeat(np.repeat(scale_inv, 128, 0), 128, 1)[:q.shape[0], :q.shape[1]]
    error = np.abs(_dequantize(q, scale_inv) - w_ref)
    assert np.all(error <= np.abs(w_ref) * 2.0**-4 + full * 2.0**-10), name
  # Measured (both stacks): scales equal or 1 ulp apart (147 of 307 blocks tiny, 66 of 114 v2-like: XLA's float32
  # division on CPU is not always correctly rounded); fp8 values bit-identical but for 2 elements (tiny), 0 (v2-like),
  # one e4m3 step each.
  assert differing <= {"tiny": 2, "v2_like": 0}[which]


def test_export_quantizer_matches_the_numpy_reference_at_edge_and_zero_blocks():
  """Measured: fp8 values bit-identical, 9 of 18 scales one float32 ulp from amax / 448."""
  w = np.random.default_rng(4).standard_normal((300, 700)).astype(np.float32) * 3
  w[:128, :128] = 0.0  # an all-zero block gets scale 1
  w_io = np.ascontiguousarray(w.T)
  q, scale_inv, _ = hf_matrices._block_quantize_transposed(w_io)  # pylint: disable=protected-access
  q_ref, s_ref = deepseek_fp8_reference.block_quantize(w)
  assert scale_inv.shape == s_ref.shape == (3, 6) and scale_inv[0, 0] == s_ref[0, 0] == 1.0
  assert deepseek_fp8_reference.ulp_distance(scale_inv, s_ref).max() <= 1
  np.testing.assert_array_equal(q.view(np.uint8), q_ref.view(np.uint8))


def test_o_proj_times_x_equals_maxtext_out_contraction(tiny):
  cfg, arrays, _, _, tensors = tiny
  attn = np.random.default_rng(3).standard_normal((cfg.num_query_heads, cfg.v_head_dim)).astype(np.float32)
  out = arrays[tree.param_key(("decoder", "moe_layers", "self_attention", "out", "kernel"))][:, 1]  # HF layer 2
  w = _dequantize(tensors["model.layers.2.self_attn.o_proj.weight"],
                  tensors["model.layers.2.self_attn.o_proj.weight_scale_inv"])
  expected = np.einsum("hd,hde->e", attn, out)
  # Measured max error 0.0213 of max |expected| (fp8 weights).
  np.testing.assert_allclose(w @ attn.reshape(-1), expected, rtol=0, atol=0.026 * np.abs(expected).max())


def test_bf16_and_f32_tensors_are_exact_roundings_of_the_maxtext_leaves(tiny):
  cfg, arrays, _, _, tensors = tiny
  p = tree.param_key
  embedding = arrays[p(("token_embedder", "embedding"))]
  head = arrays[p(("decoder", "logits_dense", "kernel"))].T
  mtp = ("mtp_block", "mtp_layer_1")
  exact = {
      "model.embed_tokens.weight": _bf16(embedding),
      "model.layers.4.embed_tokens.weight": _bf16(embedding),
      "lm_head.weight": _bf16(head),
      "model.layers.4.shared_head.head.weight": _bf16(head),
      "model.norm.weight": _bf16(arrays[p(("decoder", "decoder_norm", "scale"))]),
      "model.layers.0.input_layernorm.weight":
          _bf16(arrays[p(("decoder", "dense_layers", "pre_self_attention_layer_norm", "scale"))][:, 0]),
      "model.layers.3.self_attn.kv_a_layernorm.weight":
          _bf16(arrays[p(("decoder", "moe_layers", "self_attention", "kv_norm", "scale"))][:, 2]),
      "model.layers.1.mlp.gate.weight":
          _bf16(arrays[p(("decoder", "moe_layers", "DeepSeekMoeBlock_0", "MoeBlock_0", "gate", "kernel"))][:, 0].T),
      # MoEBiasVar: layer axis 0, kept float32.
      "model.layers.3.mlp.gate.e_score_correction_bias":
          arrays[tree.aux_key(("decoder", "moe_layers", "DeepSeekMoeBlock_0", "MoeBlock_0", "gate", "bias"))][2],
      "model.layers.4.mlp.gate.e_score_correction_bias": arrays[tree.aux_key(
          mtp + ("mtp_1_transformer_layer", "DeepSeekMoeBlock_0", "MoeBlock_0", "gate", "bias"))],
      "model.layers.4.enorm.weight": _bf16(arrays[p(mtp + ("mtp_1_embedding_norm", "scale"))]),
      "model.layers.4.hnorm.weight": _bf16(arrays[p(mtp + ("mtp_1_hidden_state_norm", "scale"))]),
      "model.layers.4.shared_head.norm.weight": _bf16(arrays[p(mtp + ("mtp_1_final_norm", "scale"))]),
      "model.layers.4.eh_proj.weight": _bf16(arrays[p(mtp + ("mtp_1_projection", "kernel"))].T),
  }
  for name, expected in exact.items():
    assert tensors[name].dtype == expected.dtype, name
    np.testing.assert_array_equal(tensors[name], expected, err_msg=name)
  # eh_proj: HF input order is [enorm(embedding), hnorm(hidden)] as in MaxText's concat.
  emb, hid = np.ones(cfg.emb_dim, np.float32), np.zeros(cfg.emb_dim, np.float32)
  kernel = arrays[p(mtp + ("mtp_1_projection", "kernel"))]
  expected = np.concatenate([emb, hid]) @ kernel
  got = tensors["model.layers.4.eh_proj.weight"].astype(np.float32) @ np.concatenate([emb, hid])
  np.testing.assert_allclose(got, expected, rtol=0, atol=0.0026 * np.abs(expected).max())  # bf16: measured 0.00214


def test_config_json_describes_deepseek_v3_with_fp8_quantization(tiny):
  cfg, _, out, summary, _ = tiny
  with open(os.path.join(out, "config.json")) as f:
    doc = json.load(f)
  assert doc == summary.config
  assert doc["quantization_config"] == {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                        "weight_block_size": [128, 128]}
  expected = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 64,
              "intermediate_size": 64, "moe_intermediate_size": 64, "num_hidden_layers": 4,
              "first_k_dense_replace": 1, "n_routed_experts": 16, "n_shared_experts": 1, "num_experts_per_tok": 8,
              "q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
              "v_head_dim": 128, "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 1024,
              "num_nextn_predict_layers": 1, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid",
              "topk_method": "noaux_tc", "norm_topk_prob": True, "n_group": 1, "topk_group": 1,
              "torch_dtype": "bfloat16", "rms_norm_eps": 1e-6, "rope_theta": 10000, "tie_word_embeddings": False,
              "max_position_embeddings": 163840, "hidden_act": "silu"}
  assert {k: doc[k] for k in expected} == expected
  assert doc["rope_scaling"] == {"type": "yarn", "rope_type": "yarn", "factor": 40,
                                 "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
                                 "mscale": 1.0, "mscale_all_dim": 1.0, "attention_factor": 1.0, "truncate": True}
  # HF's softmax scale (dq^-0.5 * mscale_all_dim term squared) equals MaxText's.
  m = 0.1 * doc["rope_scaling"]["mscale_all_dim"] * math.log(doc["rope_scaling"]["factor"]) + 1
  assert math.isclose((128 + 64) ** -0.5 * m * m, cfg.softmax_scale)


def test_deepseek2_like_config_has_v2_routing_fields(v2_like):
  cfg, _, _, summary, tensors = v2_like
  doc = summary.config
  assert doc["architectures"] == ["DeepseekV2ForCausalLM"] and doc["q_lora_rank"] is None
  assert (doc["scoring_func"], doc["topk_method"], doc["norm_topk_prob"]) == ("softmax", "greedy", False)
  assert doc["n_shared_experts"] == 2 and doc["rope_scaling"]["mscale_all_dim"] == pytest.approx(0.707)
  assert not any("e_score_correction_bias" in k or "q_a_proj" in k for k in tensors)
  assert tensors["model.layers.1.self_attn.kv_b_proj.weight_scale_inv"].shape == (1, 2)  # (2*56, 144)
  assert tensors["model.layers.0.mlp.down_proj.weight_scale_inv"].shape == (2, 2)  # (160, 136)
  assert cfg.num_decoder_layers == 3 and "model.layers.3.input_layernorm.weight" not in tensors


def _derived_layout(arrays, cfg, layout):
  """The tiny scanned arrays rearranged as `layout` ('unscanned' or 'axis0') lays them out."""
  derived = {}
  for key, value in arrays.items():
    path = key[2:]
    if path[:2] not in (("decoder", "dense_layers"), ("decoder", "moe_layers")):
      derived[key] = value
      continue
    axis = 0 if key[:2] == tree.AUX_PREFIX else cfg.param_scan_axis
    if layout == "axis0":
      derived[key] = np.ascontiguousarray(np.moveaxis(value, axis, 0))
      continue
    for index in range(value.shape[axis]):
      derived[key[:2] + (path[0], f"{path[1]}_{index}") + path[2:]] = np.take(value, index, axis=axis)
  return derived


@pytest.mark.parametrize("layout, override", [("unscanned", "scan_layers=false"), ("axis0", "param_scan_axis=0")])
def test_other_layer_layouts_export_the_same_tensors(tiny, tmp_path, layout, override):
  cfg, arrays, _, _, tensors = tiny
  other_cfg = config.resolve_config(TINY + [override])
  export_hf.write_deepseek_fp8(_derived_layout(arrays, cfg, layout), other_cfg, str(tmp_path))
  other = _read_tensors(str(tmp_path))
  assert set(other) == set(tensors)
  for name, value in tensors.items():
    np.testing.assert_array_equal(other[name].view(np.uint8), value.view(np.uint8), err_msg=name)


def test_rope_columns_of_non_interleaved_maxtext_become_hf_interleaved_pairs(tmp_path):
  cfg = config.resolve_config(TINY + ["rope_interleave=false", "mtp_num_layers=0"])
  arrays = _random_arrays(cfg, seed=2)
  export_hf.write_deepseek_fp8(arrays, cfg, str(tmp_path))
  tensors = _read_tensors(str(tmp_path))
  dn, dr, h = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.num_query_heads
  half = dr // 2
  wq_b = arrays[tree.param_key(("decoder", "dense_layers", "self_attention", "wq_b", "kernel"))][:, 0]
  q_hf = _dequantize(tensors["model.layers.0.self_attn.q_b_proj.weight"],
                     tensors["model.layers.0.self_attn.q_b_proj.weight_scale_inv"]).reshape(h, dn + dr, -1)
  # MaxText (rope_interleave=false) rotates the complex pairs (i, i + dr/2); HF rotates (2i, 2i + 1).
  mt_pairs = wq_b[:, :, dn:dn + half] + 1j * wq_b[:, :, dn + half:]  # [qr, H, dr/2]
  hf_pairs = q_hf[:, dn::2, :] + 1j * q_hf[:, dn + 1::2, :]  # [H, dr/2, qr]
  # fp8 weights: measured max error 0.0354 (rope pairs), 0.0347 (nope), 0.0361 (kv rope) of the max |weight|.
  np.testing.assert_allclose(hf_pairs.transpose(2, 0, 1), mt_pairs, rtol=0, atol=0.042 * np.abs(wq_b).max())
  np.testing.assert_allclose(q_hf[:, :dn, :].transpose(2, 0, 1), wq_b[:, :, :dn], rtol=0,
                             atol=0.042 * np.abs(wq_b).max())
  wkv_a = arrays[tree.param_key(("decoder", "moe_layers", "self_attention", "wkv_a", "kernel"))][:, 0]
  kv_hf = _dequantize(tensors["model.layers.1.self_attn.kv_a_proj_with_mqa.weight"],
                      tensors["model.layers.1.self_attn.kv_a_proj_with_mqa.weight_scale_inv"])
  kr = cfg.kv_lora_rank
  np.testing.assert_allclose((kv_hf[kr::2] + 1j * kv_hf[kr + 1::2]).T,
                             wkv_a[:, kr:kr + half] + 1j * wkv_a[:, kr + half:], rtol=0,
                             atol=0.042 * np.abs(wkv_a).max())
  with open(tmp_path / "config.json") as f:
    assert json.load(f)["rope_interleave"] is True


class _CountingMapping:
  """A lazy mapping that counts fetches per key."""

  def __init__(self, arrays):
    self.arrays, self.fetches = arrays, {}

  def keys(self):
    return self.arrays.keys()

  def __getitem__(self, key):
    self.fetches[key] = self.fetches.get(key, 0) + 1
    return self.arrays[key]


def test_each_leaf_is_fetched_exactly_once_and_mtp_copies_can_be_left_out(tiny, tmp_path):
  cfg, arrays, _, _, tensors = tiny
  lazy = _CountingMapping(arrays)
  calls = []
  export_hf.write_deepseek_fp8(lazy, cfg, str(tmp_path), mtp_shared_copies=False,
                               progress=lambda done, total, key: calls.append((done, total, key)))
  assert lazy.fetches == {key: 1 for key in arrays}
  assert [c[0] for c in calls] == list(range(len(arrays))) and {c[1] for c in calls} == {len(arrays)}
  names = set(_read_tensors(str(tmp_path)))
  assert tensors.keys() - names == {"model.layers.4.embed_tokens.weight", "model.layers.4.shared_head.head.weight"}


def _moved(arrays, old, new):
  moved = dict(arrays)
  moved[new] = moved.pop(old)
  return moved


BIAS = ("decoder", "moe_layers", "DeepSeekMoeBlock_0", "MoeBlock_0", "gate", "bias")


def test_gate_bias_is_accepted_under_params_as_maxtexts_converter_stores_it(tiny, tmp_path):
  cfg, arrays, _, _, tensors = tiny
  export_hf.write_deepseek_fp8(_moved(arrays, tree.aux_key(BIAS), tree.param_key(BIAS)), cfg, str(tmp_path))
  np.testing.assert_array_equal(_read_tensors(str(tmp_path))["model.layers.2.mlp.gate.e_score_correction_bias"],
                                tensors["model.layers.2.mlp.gate.e_score_correction_bias"])


def test_leaf_problems_are_refused_naming_the_leaf(tiny, tmp_path):
  cfg, arrays, _, _, _ = tiny
  wq_a = tree.param_key(("decoder", "moe_layers", "self_attention", "wq_a", "kernel"))
  cases = [
      ({**arrays, ("opt_state", "mu", "x"): np.zeros(1)}, "cannot export MaxText leaf opt_state.mu.x"),
      ({k: v for k, v in arrays.items() if k != wq_a}, "MaxText leaf params.params.decoder.moe_layers."
                                                       "self_attention.wq_a.kernel is missing"),
      ({**arrays, wq_a: np.zeros((64, 2, 32), np.float32)}, "has shape (64, 2, 32); the model of this "
                                                                   "config has (64, 3, 32)"),
      ({**arrays, tree.param_key(BIAS): arrays[tree.aux_key(BIAS)]}, "is given twice"),
  ]
  for bad, message in cases:
    with pytest.raises(errors.MismatchError, match=message.replace("(", r"\(").replace(")", r"\)")):
      export_hf.write_deepseek_fp8(bad, cfg, str(tmp_path))


def test_routings_without_a_hugging_face_equivalent_are_refused(tmp_path):
  for overrides, message in ((V2_LIKE + ["routed_bias=true"], "routes by plain top-k"),
                             (TINY + ["routed_score_func=softmax"], "scores experts with sigmoid")):
    cfg = config.resolve_config(overrides)
    with pytest.raises(errors.ConfigError, match=message):
      export_hf.write_deepseek_fp8({}, cfg, str(tmp_path))


def test_deepseek_v3_routing_without_bias_gets_zero_correction_bias(tmp_path):
  cfg = config.resolve_config(TINY + ["routed_bias=false"])
  export_hf.write_deepseek_fp8(_random_arrays(cfg), cfg, str(tmp_path))
  tensors = _read_tensors(str(tmp_path))
  biases = sorted(k for k in tensors if k.endswith("e_score_correction_bias"))
  assert biases == [f"model.layers.{i}.mlp.gate.e_score_correction_bias" for i in (1, 2, 3, 4)]
  assert all(not tensors[k].any() and tensors[k].dtype == np.float32 for k in biases)


def test_tied_embeddings_write_no_lm_head_and_copy_the_embedding_as_mtp_head(tmp_path):
  cfg = config.resolve_config(TINY + ["logits_via_embedding=true"])
  arrays = _random_arrays(cfg)
  summary = export_hf.write_deepseek_fp8(arrays, cfg, str(tmp_path))
  tensors = _read_tensors(str(tmp_path))
  assert "lm_head.weight" not in tensors and summary.config["tie_word_embeddings"] is True
  embedding = _bf16(arrays[tree.param_key(("token_embedder", "embedding"))])
  for name in ("model.embed_tokens.weight", "model.layers.4.embed_tokens.weight",
               "model.layers.4.shared_head.head.weight"):
    np.testing.assert_array_equal(tensors[name], embedding)


def test_yarn_softmax_multiplier_is_off_in_hf_when_maxtext_does_not_extend_the_context():
  cfg = config.resolve_config(TINY + ["max_position_embeddings=4096"])
  rope = export_hf.hf_config(cfg)["rope_scaling"]
  assert rope["mscale"] == rope["mscale_all_dim"] == 0.0  # HF: 0.1 * 0 * ln(40) + 1 = 1
  assert math.isclose(cfg.softmax_scale, (128 + 64) ** -0.5)
