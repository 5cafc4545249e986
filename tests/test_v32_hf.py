"""DeepSeek-V3.2 against a Hugging Face directory in the release's names (the indexer's `wq_b`, `wk`, `k_norm`,
`weights_proj` under `model.layers.{i}.self_attn.indexer.`): MaxText's ckpt_v32-small written as float32 safetensors
through our name mapping (`hf_names`), its keys derived from config.json, `diff` from the bare preset to agreement,
and `forward --checkpoint DIR` against MaxText's golden forward on the Orbax checkpoint."""

import json
import os
import pathlib
import shlex

import numpy as np
import orbax.checkpoint as ocp
import pytest
from safetensors import numpy as st_numpy

import test_v32
from inspect_tool.hf import names as hf_names
from inspect_tool.configuration import config
from inspect_tool.fp8_export import write_hf
from inspect_tool.paramtree import tree
from conftest import run_cli

CKPT = test_v32.CKPT
RELEASE_INDEXER = ("self_attn.indexer.wq_b.weight", "self_attn.indexer.wk.weight", "self_attn.indexer.k_norm.weight",
                   "self_attn.indexer.k_norm.bias", "self_attn.indexer.weights_proj.weight")



def _source() -> dict:
  """ckpt_v32-small's arrays (converter layout: the gate bias under params/params)."""
  import jax  # pylint: disable=import-outside-toplevel
  with ocp.StandardCheckpointer() as checkpointer:
    restored = checkpointer.restore(str(CKPT / "0" / "items"))
  flat = jax.tree_util.tree_flatten_with_path(restored["params"])[0]
  return {tree.PARAMS_PREFIX + tuple(str(k.key) for k in path[1:]): np.asarray(v, np.float32) for path, v in flat}


def write_float_hf(dst: pathlib.Path, cfg, arrays: dict) -> None:
  """float32 safetensors of `arrays` in Hugging Face DeepSeek names (one shard) and a config.json."""
  out = {}
  for key, entry in hf_names.leaf_plan(cfg).items():
    value = arrays[key] if key in arrays else arrays[tree.PARAMS_PREFIX + key[2:]]
    for s, layer in enumerate(entry.layers or (None,)):
      part = np.take(value, s, axis=entry.layer_axis) if entry.layer_axis is not None else value
      for pattern in entry.rule.names:
        name = pattern.replace("{i}", str(layer))
        if entry.rule.kind == hf_names.EXPERTS_FP8:
          out.update({name.replace("{j}", str(j)): hf_names.hf_matrix(part[j], entry.rule, cfg)
                      for j in range(part.shape[0])})
        elif entry.rule.kind in (hf_names.FP8, hf_names.BF16_LINEAR):
          out[name] = hf_names.hf_matrix(part, entry.rule, cfg)
        else:
          out[name] = np.ascontiguousarray(part, np.float32)
  dst.mkdir()
  st_numpy.save_file(out, str(dst / "model.safetensors"))
  doc = write_hf.hf_config(cfg)
  del doc["quantization_config"]
  doc["torch_dtype"] = "float32"
  (dst / "config.json").write_text(json.dumps(doc))


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
  dst = tmp_path_factory.mktemp("v32") / "hf"
  write_float_hf(dst, config.resolve_config(test_v32.SMALL), _source())
  return str(dst)


@pytest.fixture(scope="module")
def batch(tmp_path_factory):
  golden = dict(np.load(CKPT / "golden_v32_a_noquant.npz"))
  root = tmp_path_factory.mktemp("batch")
  np.save(root / "tokens.npy", golden["tokens"])
  np.save(root / "targets.npy", golden["targets"])
  return golden, str(root / "tokens.npy"), str(root / "targets.npy")


def test_the_directory_holds_the_release_names_of_the_indexer(hf_dir):
  names = set(st_numpy.load_file(os.path.join(hf_dir, "model.safetensors")))
  for layer in range(4):  # 3 decoder layers and the MTP layer
    assert {f"model.layers.{layer}.{name}" for name in RELEASE_INDEXER} <= names


def test_keys_diff_and_forward_through_the_hugging_face_names(hf_dir, batch, capsys, tmp_path):
  code, out, err = run_cli(capsys, "hf", "--path", hf_dir, "--keys")
  assert code == 0, err
  keys = out.split()
  assert keys[0] == "model_name=deepseek3.2-671b"
  assert {"use_indexer=true", "indexer_n_heads=4", "indexer_head_dim=32", "indexer_topk=8", "mtp_num_layers=1",
          "q_lora_rank=32", "kv_lora_rank=16"} <= set(keys)

  code, out, _ = run_cli(capsys, "diff", "model_name=deepseek3.2-671b", "--path", hf_dir)
  assert code == 1
  argv = shlex.split(out.rstrip().splitlines()[-1][len("try: "):])
  code, out, err = run_cli(capsys, *argv[1:])
  assert code == 0 and "AGREE" in out, out + err

  golden, tokens, targets = batch
  results = {}
  for name, source, model in (("hf", hf_dir, keys), ("orbax", str(CKPT), test_v32.SMALL)):
    saved = tmp_path / f"{name}.npz"
    code, _, err = run_cli(capsys, "forward", *model, "--checkpoint", source, "--tokens", tokens, "--targets", targets,
                        "--save-logits", saved)
    assert code == 0, err
    results[name] = dict(np.load(saved))
  np.testing.assert_array_equal(results["hf"]["logits"], results["orbax"]["logits"])
  np.testing.assert_array_equal(results["hf"]["mtp_logits"], results["orbax"]["mtp_logits"])
  logits = results["hf"]["logits"]
  assert test_v32._rel(logits, golden["logits"]) <= 0.01  # pylint: disable=protected-access
  assert int((logits.argmax(-1) == golden["top1"]).sum()) >= 31
