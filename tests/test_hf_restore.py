"""Hugging Face round trip: `export --layout deepseek-fp8`, then `forward --checkpoint`, `diff` and `hf --summary`
on it; a bf16 HF directory written here with safetensors' own API against MaxText's golden logits.

References are test-side: the FP8 tensors are decoded and dequantized by hand (test_export_hf's byte-level reader)
and each HF (out, in) matrix is the Jacobian of MaxText's own contraction of the loaded kernel; the bf16 directory's
names come from the DeepSeek-V3 release's naming, written out below.
"""

import json
import os
import shlex

import ml_dtypes
import numpy as np
import pytest

import orbax_sources
from safetensors import numpy as st_numpy

import test_export_hf as hf_ref
from inspect_tool import cli, errors, model
from inspect_tool.configuration import config
from inspect_tool.paramtree import params
from inspect_tool.paramtree import tree
from inspect_tool.hf import names as hf_names
from inspect_tool.hf import restore as hf_restore

from conftest import DATA
from conftest import run_cli
CKPT = os.path.join(DATA, "ckpt_deepseek3-tiny-L4-V1024")
L4 = ["model_name=deepseek3-tiny", "mtp_num_layers=1", "override_model_config=true", "base_num_decoder_layers=4",
      "first_num_dense_layers=1", "vocab_size=1024"]
BIAS = ("DeepSeekMoeBlock_0", "MoeBlock_0", "gate", "bias")



def _rel(x, y):
  return float(np.linalg.norm(np.asarray(x, np.float64) - y) / np.linalg.norm(y))


@pytest.fixture(scope="module")
def cfg():
  return config.resolve_config(L4)


@pytest.fixture(scope="module")
def source():
  """The MaxText checkpoint's arrays (converter layout: the gate bias under params/params)."""
  import jax  # pylint: disable=import-outside-toplevel
  restored = orbax_sources.restore_numpy(os.path.join(CKPT, "0", "items"))
  flat = jax.tree_util.tree_flatten_with_path(restored["params"])[0]
  return {("params",) + tuple(str(k.key) for k in path): np.asarray(v) for path, v in flat}


@pytest.fixture(scope="module")
def golden():
  return dict(np.load(os.path.join(DATA, "golden", "a_noquant.npz")))


@pytest.fixture(scope="module")
def batch_files(tmp_path_factory, golden):
  d = tmp_path_factory.mktemp("batch")
  np.save(d / "tokens.npy", golden["tokens"])
  np.save(d / "targets.npy", golden["targets"])
  return str(d / "tokens.npy"), str(d / "targets.npy")


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory):
  dst = tmp_path_factory.mktemp("export") / "fp8"
  assert cli.main(["export", *L4, "--checkpoint", CKPT, "--output", str(dst), "--layout", "deepseek-fp8",
                   "--no-validate"]) == 0
  return str(dst)


def _model_leaves(cfg):
  return params.param_leaves(model.build_model(cfg, abstract=True), include_non_params=True)


def _loaded(path, cfg):
  return {k: np.asarray(v) for k, v in hf_restore.restore_leaves(path, cfg, _model_leaves(cfg)).items()}


def _source_value(source, key):
  """A model leaf key's source array (the gate bias is stored under params/params)."""
  return source[key] if key in source else source[tree.param_key(key[2:])]


def _forward(capsys, path, batch_files, tmp_path, *extra):
  out = tmp_path / "logits.npz"
  code, printed, err = run_cli(capsys, "forward", *L4, *extra, "--checkpoint", path, "--tokens", batch_files[0],
                            "--targets", batch_files[1], "--save-logits", str(out))
  assert code == 0, err
  assert printed.splitlines()[1].startswith(f"weights: Hugging Face directory {os.path.abspath(path)}")
  saved = np.load(out)
  return saved["logits"], saved["mtp_logits"].reshape((-1,) + saved["logits"].shape)[0]


# The FP8 release layout -----------------------------------------------------------------------------------------


def test_fp8_export_loads_as_the_dequantized_file_tensors_exactly(fp8_dir, cfg, source):
  loaded, files = _loaded(fp8_dir, cfg), hf_ref._read_tensors(fp8_dir)
  # Every FP8 Linear weight: MaxText's contraction of the loaded kernel is the file's fp8 value × its block scale.
  matrices = hf_ref._reference_fp8(cfg, {tree.param_key(k[2:]) if k[:2] == tree.AUX_PREFIX else k: v
                                         for k, v in loaded.items()})
  assert len(matrices) == sum(n.endswith("_scale_inv") for n in files) == 232
  for name, matrix in matrices.items():
    np.testing.assert_array_equal(matrix, hf_ref._dequantize(files[name], files[name + "_scale_inv"]), err_msg=name)
  # The rest (norms, embedding, router, head, eh_proj; gate bias float32) is the source rounded as stored.
  fp8_subs = {sub for sub, _ in list(hf_ref.ATTENTION.values()) + list(hf_ref.DENSE.values())
              + list(hf_ref.SHARED.values()) + list(hf_ref.EXPERTS.values())}
  rest = [k for k in loaded if not any(k[-len(s):] == s for s in fp8_subs)]
  assert len(rest) == 23 and len(loaded) == 53
  for key in rest:
    want = _source_value(source, key)
    want = want if key[-4:] == BIAS else hf_ref._bf16(want).astype(np.float32)
    np.testing.assert_array_equal(loaded[key], want, err_msg=".".join(key))


def test_forward_of_the_fp8_export_is_the_dequantized_weights_forward(fp8_dir, cfg, source, golden, batch_files,
                                                                      tmp_path, capsys):
  """Block fp8 of the weights is lossy: measured against MaxText's golden (a), main 0.0836 relative, top-1 23/32;
  MTP 0.0903, 29/32 (random-init weights: small logits, so the relative error is large; bf16 weights give 0, see
  below). The forward equals the model run on the hand-dequantized file tensors exactly."""
  from inspect_tool.run import forward  # pylint: disable=import-outside-toplevel
  logits, mtp = _forward(capsys, fp8_dir, batch_files, tmp_path)
  reference = model.build_model(cfg)
  params.assign_arrays(reference, _loaded(fp8_dir, cfg))  # equal to the file tensors: test above
  ref = forward.run_forward(reference, golden["tokens"], targets=golden["targets"],
                            target_mask=golden["target_mask"], positions=golden["positions"],
                            segment_ids=golden["segment_ids"])
  np.testing.assert_array_equal(logits, np.asarray(ref.logits))
  np.testing.assert_array_equal(mtp, np.asarray(ref.mtp_logits[0]))
  assert 0.075 <= _rel(logits, golden["logits"]) <= 0.09
  assert int((logits.argmax(-1) == golden["top1"]).sum()) >= 22
  assert 0.08 <= _rel(mtp, golden["mtp_logits"]) <= 0.097
  assert int((mtp.argmax(-1) == golden["mtp_top1"]).sum()) >= 28


def test_diff_agrees_with_the_fp8_export_and_names_what_differs(fp8_dir, capsys):
  code, out, err = run_cli(capsys, "diff", *L4, "--path", fp8_dir)
  assert code == 0, err
  assert "AGREE" in out and "53 weights" in out
  code, out, _ = run_cli(capsys, "diff", *L4, "vocab_size=512", "mtp_num_layers=0", "--path", fp8_dir)
  assert code == 1
  assert "model.embed_tokens.weight is (1024, 64), the model needs (512, 64)" in out
  fix = out.rstrip().splitlines()[-1]
  assert fix.startswith("try: inspect_checkpoint diff model_name=deepseek3-tiny ")
  assert " vocab_size=1024 " in fix and " mtp_num_layers=1 " in fix
  code, out, _ = run_cli(capsys, *shlex.split(fix[len("try: inspect_checkpoint "):]))
  assert code == 0 and "AGREE" in out


def test_diff_does_not_read_a_fifo_in_place_of_config_json(fp8_dir, tmp_path):
  """A FIFO would block the reader forever: it is named, not read."""
  import shutil  # pylint: disable=import-outside-toplevel
  import subprocess  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel

  copy = tmp_path / "copy"
  shutil.copytree(fp8_dir, copy)
  os.remove(copy / "config.json")
  os.mkfifo(copy / "config.json")
  for command in (["diff", *L4, "vocab_size=512", "--path"], ["forward", *L4, "--checkpoint"]):
    out = subprocess.run([sys.executable, "-m", "inspect_tool", *command, str(copy)], capture_output=True, text=True,
                         timeout=120, check=False)
    assert out.returncode == 2 and out.stderr == f"error: {copy / 'config.json'}: is not a regular file\n", out.stderr


def test_hf_summary_reads_the_export(fp8_dir, capsys):
  code, out, err = run_cli(capsys, "hf", "--path", fp8_dir, "--summary")
  assert code == 0, err
  assert "routed experts" in out and "embedding and head copies" in out
  tensors = hf_ref._read_tensors(fp8_dir)  # read by the safetensors library
  scales = sum(v.size for k, v in tensors.items() if k.endswith("weight_scale_inv"))
  # MaxText's L4 total (tests/data/listings/README.md), the MTP layer's copies of embedding and head (1024 x 64 each)
  # and the gate bias of 3 MoE layers and the MTP layer (16 experts each); the scales apart
  assert sum(v.size for v in tensors.values()) == 1396848 + 2 * 1024 * 64 + 4 * 16 + scales
  assert f"Total Parameters: {1396848 + 2 * 1024 * 64 + 4 * 16} " in out and f"+ {scales} scale values" in out


def test_a_missing_tensor_is_one_line_exit_2_before_any_data_is_read(fp8_dir, tmp_path, batch_files, capsys):
  broken = tmp_path / "broken"
  broken.mkdir()
  files = hf_ref._read_tensors(fp8_dir)
  files.pop("model.layers.2.mlp.experts.3.up_proj.weight_scale_inv")
  st_numpy.save_file(files, str(broken / "model.safetensors"))
  (broken / "config.json").write_text(open(os.path.join(fp8_dir, "config.json"), encoding="utf-8").read())
  code, _, err = run_cli(capsys, "forward", *L4, "--checkpoint", str(broken), "--tokens", batch_files[0])
  assert code == 2 and len(err.strip().splitlines()) == 1
  assert "model.layers.2.mlp.experts.3.up_proj.weight_scale_inv is missing" in err
  code, out, _ = run_cli(capsys, "diff", *L4, "--path", str(broken))
  assert code == 1 and "up_proj.weight_scale_inv is missing" in out


def test_read_block_reads_any_device_shard_of_a_stacked_leaf(fp8_dir, cfg):
  plan, tensors = hf_names.leaf_plan(cfg), hf_restore.Tensors(fp8_dir)
  key = tree.param_key(("decoder", "moe_layers", "DeepSeekMoeBlock_0", "MoeBlock_0", "wi_0"))
  full = hf_restore.read_block(tensors, plan[key], (), cfg)
  assert full.shape == (16, 3, 64, 64)
  for index in [(slice(4, 8),), (slice(0, 16), slice(1, 3)), (slice(None), slice(None), slice(32, 64))]:
    np.testing.assert_array_equal(hf_restore.read_block(tensors, plan[key], index, cfg), full[index])


# A bf16 directory in DeepSeek's names ---------------------------------------------------------------------------


def _deepseek_bf16_tensors(cfg, source):
  """HF name -> array of the L4 checkpoint in DeepSeek-V3's names: Linear weights (out, in) in bf16 (the
  Jacobians of MaxText's contractions), norms and embedding bf16, e_score_correction_bias float32."""
  arrays = {k: v for k, v in source.items()}
  tensors = {name: hf_ref._bf16(m) for name, m in hf_ref._reference_fp8(cfg, arrays).items()}
  p = tree.param_key
  tensors["model.embed_tokens.weight"] = hf_ref._bf16(source[p(("token_embedder", "embedding"))])
  tensors["model.norm.weight"] = hf_ref._bf16(source[p(("decoder", "decoder_norm", "scale"))])
  tensors["lm_head.weight"] = hf_ref._bf16(source[p(("decoder", "logits_dense", "kernel"))].T)
  big_l, d = cfg.num_decoder_layers, cfg.first_num_dense_layers
  for i in range(big_l + cfg.mtp_num_layers):
    layer = f"model.layers.{i}."
    for hf, sub in (("input_layernorm", "pre_self_attention_layer_norm"),
                    ("post_attention_layernorm", "post_self_attention_layer_norm"),
                    ("self_attn.q_a_layernorm", "self_attention/q_norm"),
                    ("self_attn.kv_a_layernorm", "self_attention/kv_norm")):
      tensors[layer + hf + ".weight"] = hf_ref._bf16(hf_ref._layer_kernel(arrays, cfg, i, tuple(sub.split("/"))
                                                                           + ("scale",)))
    if i >= d:
      gate = ("DeepSeekMoeBlock_0", "MoeBlock_0", "gate")
      tensors[layer + "mlp.gate.weight"] = hf_ref._bf16(hf_ref._layer_kernel(arrays, cfg, i, gate + ("kernel",)).T)
      bias = (source[p(("decoder", "moe_layers") + BIAS)][i - d] if i < big_l else
              source[p(("mtp_block", "mtp_layer_1", "mtp_1_transformer_layer") + BIAS)])
      tensors[layer + "mlp.gate.e_score_correction_bias"] = bias.astype(np.float32)
  mtp = ("mtp_block", "mtp_layer_1")
  for hf, name in (("enorm", "embedding_norm"), ("hnorm", "hidden_state_norm"), ("shared_head.norm", "final_norm")):
    tensors[f"model.layers.{big_l}.{hf}.weight"] = hf_ref._bf16(source[p(mtp + (f"mtp_1_{name}", "scale"))])
  tensors[f"model.layers.{big_l}.eh_proj.weight"] = hf_ref._bf16(source[p(mtp + ("mtp_1_projection", "kernel"))].T)
  return tensors


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory, cfg, source, fp8_dir):
  d = tmp_path_factory.mktemp("bf16")
  tensors = _deepseek_bf16_tensors(cfg, source)
  names = sorted(tensors)
  half = len(names) // 2
  weight_map = {}
  for k, part in enumerate((names[:half], names[half:]), start=1):
    shard = f"model-{k:05d}-of-00002.safetensors"
    # C order: safetensors' numpy writer stores a transposed view's buffer as it lies in memory
    st_numpy.save_file({n: np.ascontiguousarray(tensors[n]) for n in part}, str(d / shard),
                       metadata={"format": "pt"})
    weight_map.update({n: shard for n in part})
  (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
  hf_config = json.loads(open(os.path.join(fp8_dir, "config.json"), encoding="utf-8").read())
  hf_config.pop("quantization_config")
  (d / "config.json").write_text(json.dumps(hf_config))
  return str(d), tensors


def test_bf16_layout_loads_the_stored_values(bf16_dir, cfg, source):
  path, tensors = bf16_dir
  assert not any(t.dtype == ml_dtypes.float8_e4m3fn for t in tensors.values()) and len(tensors) == 267
  loaded = _loaded(path, cfg)
  assert len(loaded) == len(_model_leaves(cfg)) == 53
  for key, value in loaded.items():
    want = _source_value(source, key)
    want = want if key[-4:] == BIAS else hf_ref._bf16(want).astype(np.float32)
    np.testing.assert_array_equal(value, want, err_msg=".".join(key))


def test_bf16_layout_reproduces_maxtext_golden_logits(bf16_dir, golden, batch_files, tmp_path, capsys):
  """bf16 weights lose nothing here: MaxText's compute dtype is bf16, every weight is rounded to bf16 before its
  matmul, so the golden (a) is reproduced exactly (measured: relative error 0, top-1 32/32, main and MTP), far
  inside tolerance (a) (rel <= 0.01, top-1 >= 31/32)."""
  logits, mtp = _forward(capsys, bf16_dir[0], batch_files, tmp_path)
  assert _rel(logits, golden["logits"]) <= 1e-6 and int((logits.argmax(-1) == golden["top1"]).sum()) == 32
  assert _rel(mtp, golden["mtp_logits"]) <= 1e-6 and int((mtp.argmax(-1) == golden["mtp_top1"]).sum()) == 32
  code, out, _ = run_cli(capsys, "diff", *L4, "--path", bf16_dir[0])
  assert code == 0 and "AGREE" in out


def test_an_hf_directory_that_is_not_a_deepseek_model_does_not_fit(tmp_path, capsys):
  st_numpy.save_file({"transformer.h.0.attn.weight": np.zeros((4, 4), np.float32)}, str(tmp_path / "m.safetensors"))
  (tmp_path / "config.json").write_text("{}")
  assert hf_restore.is_hf_checkpoint(str(tmp_path))
  with pytest.raises(errors.MismatchError, match="model.embed_tokens.weight is missing"):
    _loaded(str(tmp_path), config.resolve_config(L4))


def test_rope_columns_go_back_to_maxtexts_halves_layout_for_rope_interleave_false(fp8_dir, cfg):
  """HF's interleaved rope pair (2i, 2i+1) is MaxText's (i, i + dr/2) when rope_interleave=false."""
  split_cfg = config.resolve_config(L4 + ["rope_interleave=false"])
  interleaved, split = _loaded(fp8_dir, cfg), _loaded(fp8_dir, split_cfg)
  dr = cfg.qk_rope_head_dim
  rope_keys = [k for k in interleaved if k[-2] in ("wq_b", "wkv_a")]
  assert len(rope_keys) == 6  # dense, MoE and MTP layers
  for key in interleaved:
    a, b = interleaved[key], split[key]
    if key not in rope_keys:
      np.testing.assert_array_equal(a, b)
      continue
    start = a.shape[-1] - dr
    np.testing.assert_array_equal(a[..., :start], b[..., :start])
    np.testing.assert_array_equal(a[..., start::2], b[..., start:start + dr // 2])
    np.testing.assert_array_equal(a[..., start + 1::2], b[..., start + dr // 2:])
    assert not np.array_equal(a, b)


_SHARDED_READ = """
import sys
import jax, numpy as np
from inspect_tool import model
from inspect_tool.configuration import config
from inspect_tool.paramtree import params
from inspect_tool.hf import restore as hf_restore
cfg = config.resolve_config(sys.argv[2:])
leaves = params.param_leaves(model.build_model(cfg, abstract=True), include_non_params=True)
four = hf_restore.restore_leaves(sys.argv[1], cfg, leaves)
one = hf_restore.restore_leaves(sys.argv[1], cfg, leaves, mesh=jax.sharding.Mesh(np.array(jax.devices()[:1]), ("d",)))
assert jax.device_count() == 4
sharded = [k for k, v in four.items() if not v.sharding.is_fully_replicated]
assert all(np.array_equal(np.asarray(four[k]), np.asarray(one[k])) for k in four)
print(len(four), len(sharded))
"""


def test_a_four_device_mesh_reads_each_shard_and_assembles_the_same_arrays(fp8_dir):
  import subprocess  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
  done = subprocess.run([sys.executable, "-c", _SHARDED_READ, fp8_dir, *L4], env=env, capture_output=True,
                        text=True, timeout=600, check=False)
  assert done.returncode == 0, done.stderr[-2000:]
  assert done.stdout.split() == ["53", "53"]
