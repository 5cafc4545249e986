"""One translation of a Hugging Face DeepSeek directory's config.json into MaxText keys (`hf_config`), checked against
transformers: `tests/data/import/hf_small` is a DeepSeek-V3 made and saved by transformers 5.24 (float32, non-zero
routing bias, an MTP layer as the release stores it; see tests/data/README.md, import/) and
`hf_small_transformers_logits.npz` transformers' float32 logits of its base model on `tokens.npy`.

The `rope_interleave: false` copy is an independent reference too: transformers' `apply_rotary_pos_emb_interleave`
de-interleaves q and k (`view(d/2, 2).transpose`) before `rotate_half`, so storing the rope rows already
de-interleaved with `rope_interleave: false` makes transformers compute the same logits.
"""

import json
import os
import shutil

import numpy as np
import pytest
from safetensors import numpy as st_numpy


from conftest import DATA as DATA_DIR
from conftest import run_cli
DATA = os.path.join(DATA_DIR, "import")
HF = os.path.join(DATA, "hf_small")
KEYS = ("model_name=deepseek3-671b override_model_config=true base_emb_dim=128 base_num_query_heads=2 "
        "base_num_kv_heads=2 base_mlp_dim=256 base_moe_mlp_dim=64 base_num_decoder_layers=3 first_num_dense_layers=1 "
        "vocab_size=512 num_experts=8 num_experts_per_tok=2 shared_experts=1 routed_scaling_factor=1.5 "
        "routed_score_func=sigmoid routed_bias=true n_routing_groups=2 topk_routing_group=1 q_lora_rank=64 "
        "kv_lora_rank=32 qk_nope_head_dim=32 qk_rope_head_dim=16 v_head_dim=32 normalization_layer_epsilon=1e-06 "
        "logits_via_embedding=false rope_type=yarn rope_max_timescale=10000 max_position_embeddings=8192 "
        "original_max_position_embeddings=2048 rope_factor=4.0 beta_fast=32.0 beta_slow=1.0 mscale=1.0 "
        "rope_truncate=true rope_attention_scaling=false rope_interleave=true mtp_num_layers=1")



def _rel(x, y):
  return float(np.linalg.norm(np.asarray(x, np.float64) - y) / np.linalg.norm(y))


def _copy(tmp_path, edit_config=None, edit_tensors=None) -> str:
  """A copy of hf_small with its config.json and tensors edited."""
  dst = tmp_path / "hf"
  shutil.copytree(HF, dst)
  os.chmod(dst, 0o755)
  for name in os.listdir(dst):
    os.chmod(dst / name, 0o644)
  if edit_config:
    doc = json.loads((dst / "config.json").read_text())
    edit_config(doc)
    (dst / "config.json").write_text(json.dumps(doc))
  if edit_tensors:
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    index["weight_map"] = {}
    for name in sorted(os.listdir(dst)):
      if name.endswith(".safetensors"):
        tensors = edit_tensors(st_numpy.load_file(str(dst / name)))
        st_numpy.save_file(tensors, str(dst / name))
        index["weight_map"].update(dict.fromkeys(tensors, name))
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
  return str(dst)


def _forward_logits(capsys, tmp_path, path, keys):
  out = tmp_path / "logits.npz"
  code, _, err = run_cli(capsys, "forward", *keys.split(), "dtype=float32", "--checkpoint", path,
                      "--tokens", os.path.join(DATA, "tokens.npy"), "--save-logits", out)
  assert code == 0, err
  return np.load(out)["logits"]


def test_keys_line_is_the_whole_translation_of_config_json(capsys):
  code, out, err = run_cli(capsys, "hf", "--path", HF, "--keys")
  assert code == 0, err
  assert out == KEYS + "\n"


def test_transformers_4_spelling_gives_the_same_keys(tmp_path, capsys):
  def to_rope_scaling(doc):
    params = doc.pop("rope_parameters")
    doc["rope_theta"] = params.pop("rope_theta")
    doc["rope_scaling"] = params
  code, out, _ = run_cli(capsys, "hf", "--path", _copy(tmp_path, to_rope_scaling), "--keys")
  assert code == 0 and out == KEYS + "\n"


def test_forward_with_the_derived_keys_equals_transformers(tmp_path, capsys):
  reference = np.load(os.path.join(DATA, "hf_small_transformers_logits.npz"))["logits"]
  logits = _forward_logits(capsys, tmp_path, HF, KEYS)
  assert _rel(logits, reference) <= 1e-5  # measured 3.8e-7
  assert (logits.argmax(-1) == reference.argmax(-1)).all()


def test_rope_stored_in_halves_is_not_read_as_interleaved(tmp_path, capsys):
  dr, dq, kr = 16, 48, 32

  def halves(rows):
    return np.concatenate([rows[0::2], rows[1::2]])

  def deinterleave(tensors):
    out = dict(tensors)
    for name, value in tensors.items():
      if name.endswith("self_attn.q_b_proj.weight"):
        heads = value.reshape(-1, dq, value.shape[-1]).copy()
        heads[:, dq - dr:] = np.stack([halves(h[dq - dr:]) for h in heads])
        out[name] = heads.reshape(value.shape)
      elif name.endswith("self_attn.kv_a_proj_with_mqa.weight"):
        out[name] = np.concatenate([value[:kr], halves(value[kr:])])
    return out

  path = _copy(tmp_path, lambda doc: doc.update(rope_interleave=False), deinterleave)
  code, out, _ = run_cli(capsys, "hf", "--path", path, "--keys")
  assert code == 0 and out == KEYS.replace("rope_interleave=true", "rope_interleave=false") + "\n"
  reference = np.load(os.path.join(DATA, "hf_small_transformers_logits.npz"))["logits"]
  logits = _forward_logits(capsys, tmp_path, path, out.strip())
  assert _rel(logits, reference) <= 1e-5
  code, _, err = run_cli(capsys, "forward", *KEYS.split(), "dtype=float32", "--checkpoint", path)
  assert code == 2 and err.count("\n") == 1
  assert "rope_interleave: the model has true, config.json gives rope_interleave=false" in err


@pytest.mark.parametrize("key, value, named", [
    ("routed_bias", "false", "routed_bias: the model has false, config.json gives routed_bias=true"),
    ("rope_factor", "40", "rope_factor: the model has 40, config.json gives rope_factor=4.0"),
    ("normalization_layer_epsilon", "1e-5", "config.json gives normalization_layer_epsilon=1e-06"),
    ("n_routing_groups", "-1", "routing groups (n_routing_groups, topk_routing_group): the model has none, "
                               "config.json gives (2, 1)"),
])
def test_keys_that_contradict_config_json_are_refused_by_forward_and_reported_by_diff(key, value, named, capsys):
  keys = [t if not t.startswith(key + "=") else f"{key}={value}" for t in KEYS.split()]
  code, _, err = run_cli(capsys, "forward", *keys, "--checkpoint", HF)
  assert code == 2 and err.count("\n") == 1 and named in err, err
  code, out, _ = run_cli(capsys, "diff", *keys, "--path", HF)
  assert code == 1 and named in out
  assert out.splitlines()[-1] == f"try: inspect_checkpoint diff {' '.join(KEYS.split())} --path {HF}"


def test_the_published_keys_agree_with_diff(capsys):
  code, out, _ = run_cli(capsys, "diff", *KEYS.split(), "--path", HF)
  assert code == 0 and "AGREE" in out


@pytest.mark.parametrize("edit, named", [
    (lambda d: d.update(hidden_size="128"), "hidden_size is '128'; expected a positive integer"),
    (lambda d: d.update(rms_norm_eps=[1e-6]), "rms_norm_eps is list; expected a number"),
    (lambda d: d.update(rope_interleave="false"), "rope_interleave is 'false'; expected true or false"),
    (lambda d: d["rope_parameters"].update(factor="4"), "rope_parameters.factor is '4'; expected a number"),
    (lambda d: d.update(q_lora_rank=0), "q_lora_rank is 0; expected a positive integer or null"),
    (lambda d: d.update(quantization_config="fp8"), "quantization_config is 'fp8'; expected an object or null"),
    (lambda d: d.update(quantization_config=7), "quantization_config is 7; expected an object or null"),
    (lambda d: d.update(quantization_config=[128]), "quantization_config is list; expected an object or null"),
])
def test_a_wrong_json_type_is_one_line_naming_the_field(tmp_path, capsys, edit, named):
  path = _copy(tmp_path, edit)
  for argv in (["hf", "--path", path, "--keys"], ["diff", "model_name=deepseek3-tiny", "--path", path],
               ["import", "--path", path, "--output", str(tmp_path / "imported")],
               ["forward", "model_name=deepseek3-tiny", "--checkpoint", path]):
    code, out, err = run_cli(capsys, *argv)
    assert code == 2 and out == "" and err == f"error: {os.path.join(path, 'config.json')}: {named}\n"
  assert not (tmp_path / "imported").exists()


@pytest.mark.parametrize("edit, named", [
    (lambda d: d.update(scoring_func="softmax"), "DeepSeek-V3 routing with scoring_func='softmax'"),
    (lambda d: d.update(norm_topk_prob=False), "norm_topk_prob=false cannot be expressed in MaxText"),
    (lambda d: d.update(hidden_act="gelu"), "hidden_act='gelu' cannot be expressed"),
    (lambda d: d["rope_parameters"].update(rope_type="linear", type="linear"), "rope type 'linear' cannot be"),
    (lambda d: d["rope_parameters"].update(attention_factor=1.2), "rope attention factor 1.2 cannot be expressed"),
    (lambda d: d.update(model_type="llama"), "model_type 'llama' is not a DeepSeek model MaxText builds"),
])
def test_a_setting_maxtext_cannot_express_is_one_line_exit_2(tmp_path, capsys, edit, named):
  code, out, err = run_cli(capsys, "hf", "--path", _copy(tmp_path, edit), "--keys")
  assert code == 2 and out == "" and err.count("\n") == 1 and named in err, err


def test_a_yarn_factor_other_than_the_ratio_of_the_lengths_is_read_as_transformers_5_reads_it(tmp_path, capsys):
  """transformers 5.24 keeps the factor written (with a warning) where older versions took the ratio of
  max_position_embeddings to the original length (tests/data/transformers_rope.json records 5.24's reading)."""
  code, out, _ = run_cli(capsys, "hf", "--path", _copy(tmp_path, lambda d: d["rope_parameters"].update(factor=8.0)),
                      "--keys")
  assert code == 0 and "rope_factor=8.0" in out.split()


def test_mtp_layers_are_the_stored_ones_not_num_nextn_predict_layers(tmp_path, capsys):
  def without_mtp(tensors):
    return {k: v for k, v in tensors.items() if not k.startswith("model.layers.3.")}

  path = _copy(tmp_path, edit_tensors=without_mtp)
  code, out, _ = run_cli(capsys, "hf", "--path", path, "--keys")
  assert code == 0 and out.split()[-1] == "mtp_num_layers=0"  # config.json still says num_nextn_predict_layers 1
  code, out, _ = run_cli(capsys, "diff", *KEYS.split(), "--path", path)
  assert code == 1 and out.splitlines()[-1].split()[-3] == "mtp_num_layers=0"


def test_forward_without_mtp_names_the_unused_mtp_tensors(capsys, tmp_path):
  keys = KEYS.replace("mtp_num_layers=1", "mtp_num_layers=0").split()
  code, _, err = run_cli(capsys, "forward", *keys, "--checkpoint", HF)
  assert code == 0
  unused = [line for line in err.splitlines() if line.startswith("note:")]
  with open(os.path.join(HF, "model.safetensors.index.json"), encoding="utf-8") as f:
    mtp = [name for name in json.load(f)["weight_map"] if name.startswith("model.layers.3.")]
  assert len(unused) == 1 and f"holds {len(mtp)} array(s) the model does not use: model.layers.3." in unused[0]


# DeepSeek's published config.json of DeepSeek-V3 / R1 (transformers 4 spelling; fields that do not change the
# model left out), and of DeepSeek-V2.5 (236B), whose group-limited softmax routing MaxText's deepseek2 lacks.
PUBLISHED_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "attention_bias": False,
    "first_k_dense_replace": 3, "hidden_act": "silu", "hidden_size": 7168, "intermediate_size": 18432,
    "kv_lora_rank": 512, "max_position_embeddings": 163840, "moe_intermediate_size": 2048, "moe_layer_freq": 1,
    "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 128,
    "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128, "num_nextn_predict_layers": 1,
    "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
    "rms_norm_eps": 1e-06, "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                                            "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                                            "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "tie_word_embeddings": False,
    "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16", "v_head_dim": 128, "vocab_size": 129280}


def _published(tmp_path, doc, tensors):
  (tmp_path / "config.json").write_text(json.dumps(doc))
  st_numpy.save_file(tensors, str(tmp_path / "model.safetensors"))  # headers are all the keys need
  return str(tmp_path)


def test_deepseeks_published_v3_config_is_maxtexts_deepseek3_671b(tmp_path, capsys):
  from inspect_tool.hf import config as hf_config  # pylint: disable=import-outside-toplevel
  from inspect_tool.configuration import config  # pylint: disable=import-outside-toplevel
  path = _published(tmp_path, PUBLISHED_V3, {
      "model.layers.3.mlp.gate.e_score_correction_bias": np.zeros(256, np.float32),
      "model.layers.61.eh_proj.weight": np.zeros((1, 1), np.float32)})
  keys = hf_config.derive_keys(path)
  assert keys["mtp_num_layers"] == 1 and keys["routed_bias"] is True
  # MaxText's preset leaves group-limited routing off (its yml: "set 8 / 4 to get DeepSeek's device-limited
  # routing"): the one way it computes differently from DeepSeek's config.
  maxtext = config.resolve_config(["model_name=deepseek3-671b", "mtp_num_layers=1"])
  assert [key for key, _ in hf_config.conflicts(maxtext, keys, path)] == ["n_routing_groups"]
  grouped = config.resolve_config(["model_name=deepseek3-671b", "mtp_num_layers=1", "override_model_config=true",
                                   "n_routing_groups=8", "topk_routing_group=4"])
  assert hf_config.conflicts(grouped, keys, path) == []
  tiny = config.resolve_config(["model_name=deepseek3-tiny", "mtp_num_layers=1"])
  assert [key for key, _ in hf_config.conflicts(tiny, keys, path)] == [
      "base_emb_dim", "base_num_query_heads", "base_num_kv_heads", "base_mlp_dim", "base_moe_mlp_dim",
      "num_experts", "q_lora_rank", "kv_lora_rank", "n_routing_groups"]


def test_deepseek_v25_group_limited_softmax_routing_is_refused(tmp_path, capsys):
  v25 = dict(PUBLISHED_V3, architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2", first_k_dense_replace=1,
             intermediate_size=12288, moe_intermediate_size=1536, n_routed_experts=160, n_shared_experts=2,
             norm_topk_prob=False, num_experts_per_tok=6, num_hidden_layers=60, routed_scaling_factor=16.0,
             scoring_func="softmax", topk_group=3, topk_method="group_limited_greedy", vocab_size=102400)
  path = _published(tmp_path, v25, {"model.embed_tokens.weight": np.zeros((1, 1), np.float32)})
  code, out, err = run_cli(capsys, "hf", "--path", path, "--keys")
  assert code == 2 and out == "" and err.count("\n") == 1
  assert "topk_method='group_limited_greedy'" in err and "topk_group/n_group=3/8" in err
