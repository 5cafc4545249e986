"""Config resolution: presets, typed key=value parsing, MaxText's override and validation rules."""

import pytest

from inspect_tool import errors
from inspect_tool.configuration import config
from conftest import DATA


def test_preset_sizes_and_derived_values():
  cfg = config.resolve_config(["model_name=deepseek3-671b", "mtp_num_layers=1"])
  assert (cfg.emb_dim, cfg.num_query_heads, cfg.num_decoder_layers, cfg.num_moe_layers) == (7168, 128, 61, 58)
  assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.q_lora_rank, cfg.vocab_size) == (256, 8, 1536, 129280)
  assert cfg.deepseek_routing and cfg.mtp_num_layers == 1
  assert cfg.softmax_scale == pytest.approx(0.1352338, abs=1e-7)


def test_deepseek2_is_not_deepseek_routing_and_has_its_own_softmax_scale():
  cfg = config.resolve_config(["model_name=deepseek2-16b"])
  assert not cfg.deepseek_routing and cfg.q_lora_rank == 0 and not cfg.routed_bias
  assert cfg.softmax_scale == pytest.approx(0.1147214, abs=1e-7)


@pytest.mark.parametrize("text,expected", [("true", True), ("True", True), ("1", True), ("false", False),
                                           ("False", False), ("0", False)])
def test_bool_spellings(text, expected):
  assert config.resolve_config(["model_name=default", f"scan_layers={text}"]).scan_layers is expected


def test_typed_values_ints_floats_lists():
  cfg = config.resolve_config(["model_name=default", "mtp_loss_scaling_factor=0.25", "max_target_length=1_024",
                               "mlp_activations=[silu,linear]", "weight_sparsity_n=2", "weight_sparsity_m=4"])
  assert cfg.mtp_loss_scaling_factor == 0.25 and cfg.max_target_length == 1024
  assert cfg.mlp_activations == ("silu", "linear") and (cfg.weight_sparsity_n, cfg.weight_sparsity_m) == (2, 4)


def test_model_keys_need_override_model_config():
  with pytest.raises(errors.ConfigError, match="override_model_config=true"):
    config.resolve_config(["model_name=deepseek3-tiny", "base_num_decoder_layers=4"])
  cfg = config.resolve_config(["model_name=deepseek3-tiny", "override_model_config=true", "base_num_decoder_layers=4"])
  assert cfg.num_decoder_layers == 4
  # The same value as the model file is not a conflict.
  assert config.resolve_config(["model_name=deepseek3-tiny", "base_emb_dim=64"]).emb_dim == 64


def test_global_parameter_scale_scales_sizes():
  cfg = config.resolve_config(["model_name=deepseek3-tiny", "global_parameter_scale=8"])
  assert (cfg.emb_dim, cfg.num_query_heads, cfg.moe_mlp_dim, cfg.num_decoder_layers) == (128, 8, 128, 122)


@pytest.mark.parametrize("tokens,message", [
    (["model_name=nope"], "unknown model_name 'nope'; known: "),
    (["mtp_num_layer=1"], "did you mean 'mtp_num_layers'"),
    (["scan_layers=maybe"], "scan_layers='maybe' is not a boolean"),
    (["mtp_num_layers=one"], "mtp_num_layers='one' is not an integer"),
    (["model_name"], "not of the form key=value"),
    (["=3"], "not of the form key=value"),
    (["vocab_size=-1"], "vocab_size=-1 must be a positive integer"),
    (["mtp_num_layers=-2"], "mtp_num_layers=-2 must be >= 0"),
    (["enable_nnx=false"], "enable_nnx=false is not supported"),
    (["quantize_mtp=true", "quantization=fp8_full"], "needs mtp_num_layers > 0"),
    (["quantize_mtp=true", "mtp_num_layers=1", "quantization=int8"], "needs quantization=fp8_full"),
    (["quantization=fp9"], "quantization='fp9'; accepted:"),
    (["quantize_logits_proj=true", "quantization=fp8"], "quantize_logits_proj=true needs quantization=fp8_full"),
    (["quantization=fp8_full", "float32_gate_logits=true"], "quantize_router_proj"),
])
def test_bad_input_is_one_clear_line(tokens, message):
  with pytest.raises(errors.ConfigError) as info:
    config.resolve_config(["model_name=default"] + tokens)
  assert message in str(info.value) and "\n" not in str(info.value)


def test_a_model_must_be_named():
  with pytest.raises(errors.ConfigError, match="no model given: pass model_name=<one of .*deepseek2-16b"):
    config.resolve_config(["mtp_num_layers=1"])
  assert config.resolve_config(["model_name=default"]).model_name == "default"


def test_enable_nnx_true_and_maxtext_run_keys_are_accepted():
  cfg = config.resolve_config(["model_name=deepseek3-tiny", "enable_nnx=true", "run_name=x", "attention=dot_product",
                               "skip_jax_distributed_system=true"])
  assert cfg.enable_nnx


def test_user_model_file(tmp_path):
  path = tmp_path / "mini.yml"
  path.write_text("base_emb_dim: 32\nbase_num_query_heads: 2\nbase_num_kv_heads: 2\nnum_experts: 4\n"
                  "num_experts_per_tok: 2\nrouted_score_func: sigmoid\nbase_num_decoder_layers: 3\n"
                  "first_num_dense_layers: 1\nq_lora_rank: 8\nkv_lora_rank: 8\nvocab_size: 100\n")
  cfg = config.resolve_config([f"model_file={path}", "mtp_num_layers=1"])
  assert cfg.model_name == "mini" and cfg.emb_dim == 32 and cfg.num_moe_layers == 2
  with pytest.raises(errors.ConfigError, match="override_model_config"):
    config.resolve_config([str(path), "num_experts=8"])


def test_bad_model_file(tmp_path):
  path = tmp_path / "bad.yml"
  path.write_text("base_emb_dim: [1, 2\n")
  with pytest.raises(errors.ConfigError, match="not valid YAML"):
    config.resolve_config([f"model_file={path}"])
  path.write_text("emb_dimm: 3\n")
  with pytest.raises(errors.UnknownKeyError, match="emb_dimm"):
    config.resolve_config([f"model_file={path}"])
  with pytest.raises(errors.ConfigError, match="does not exist"):
    config.resolve_config([f"model_file={tmp_path / 'missing.yml'}"])


# ---------------------------------------------------------------------------------------------------------
# Every MaxText 0.2.5 key (tests/data/maxtext_0.2.5_base_keys.txt, a copy of MaxText's base.yml keys and defaults).

def _maxtext_base_keys() -> dict:
  import os  # pylint: disable=import-outside-toplevel

  import yaml  # pylint: disable=import-outside-toplevel

  path = os.path.join(DATA, "maxtext_0.2.5_base_keys.txt")
  with open(path, encoding="utf-8") as f:
    return {k: None if v == "None" else v for k, v in yaml.safe_load(f).items()}


def _as_token(key, value) -> str:
  import yaml  # pylint: disable=import-outside-toplevel

  text = value if isinstance(value, str) else yaml.safe_dump(value, default_flow_style=True, width=10**6)
  return f"{key}={text.strip().removesuffix('...').strip()}"


def test_every_maxtext_key_is_accepted_at_its_default_and_typed_like_it():
  keys = _maxtext_base_keys()
  assert len(keys) == 786
  others = {k: v for k, v in keys.items() if k not in config.FIELDS}
  cfg = config.resolve_config(["model_name=deepseek3-tiny"] + [_as_token(k, v) for k, v in others.items()])
  for key, value in others.items():
    assert getattr(cfg, key) == value, key  # given on the command line, read back typed as MaxText types it
  # Fields keep MaxText's defaults, except where this tool documents another (it builds DeepSeek MLA with Qwix).
  differ = {k for k in config.FIELDS if k in keys and (lambda v: list(v) if isinstance(v, tuple) else v)(
      config.FIELDS[k].default) != keys[k]}
  assert differ == {"use_qwix_quantization", "decoder_block", "attention_type", "base_moe_mlp_dim"}


def test_sharding_and_training_keys_parse_to_maxtext_types():
  cfg = config.resolve_config([
      "model_name=deepseek3-tiny", "ici_fsdp_parallelism=8", "dcn_data_parallelism=-1", "mesh_axes=[data,fsdp]",
      "logical_axis_rules=[[embed,[fsdp]],[mlp,[]],[layers,stage]]", "opt_type=sgd", "learning_rate=1e-4",
      "shard_mode=explicit", "use_batch_split_schedule=true", "run_name=123", "steps=10"])
  assert cfg.ici_fsdp_parallelism == 8 and cfg.dcn_data_parallelism == -1
  assert cfg.mesh_axes == ["data", "fsdp"]
  assert cfg.logical_axis_rules == [["embed", ["fsdp"]], ["mlp", []], ["layers", "stage"]]
  assert cfg.opt_type == "sgd" and cfg.learning_rate == 1e-4 and cfg.run_name == "123" and cfg.steps == 10
  assert cfg.use_batch_split_schedule is True and cfg.shard_mode == "explicit"
  # Not given: MaxText's defaults.
  assert cfg.ici_expert_parallelism == 1 and cfg.mesh_axes != config.resolve_config(
      ["model_name=deepseek3-tiny"]).mesh_axes
  assert config.resolve_config(["model_name=deepseek3-tiny"]).mesh_axes[:3] == ["diloco", "data", "stage"]
  # Ignored keys never change what the model is.
  assert cfg == config.resolve_config(["model_name=deepseek3-tiny"])


@pytest.mark.parametrize("tokens,message", [
    (["ici_fsdp_parallelism=eight"], "ici_fsdp_parallelism='eight' is not an integer"),
    (["mesh_axes=data"], "mesh_axes='data' is not a list"),
    (["ici_fsdp_paralelism=4"], "did you mean 'ici_fsdp_parallelism'"),
    (["mlp_bias=true"], "mlp_bias=True is not supported"),
    (["use_random_routing=true"], "use_random_routing=True is not supported"),
    (["quantization=fp8_full", "use_qwix_quantization=false"], "selects MaxText's AQT path"),
    (["quantization=fp8_full", "weight_quantization_calibration_method=minmax"], "minmax' is not supported"),
    (["quantization=fp8_full", "act_quantization_calibration_method=fixed,-1,2"], "is not supported"),
    (["model_name=llama3-8b"], "outside the DeepSeek family; this tool builds DeepSeek-family models: "),
    (["model_name=deepseek3-tiny", "base_mlp_dim=32", "first_num_dense_layers=0", "override_model_config=true"],
     "fully MoE model"),
    (["model_name=deepseek3-671b-batchsplit", "quantization=fp8_full"], "MaxText's batch-split DeepSeek model"),
])
def test_maxtext_keys_bad_input_is_one_clear_line(tokens, message):
  with pytest.raises(errors.ConfigError) as info:
    config.resolve_config(["model_name=deepseek3-tiny"] + tokens if not tokens[0].startswith("model_name")
                          else tokens)
  assert message in str(info.value) and "\n" not in str(info.value)


def test_calibrations_the_run_accepts_pass_validation():
  cfg = config.resolve_config(["model_name=deepseek3-tiny", "quantization=fp8_full", "mlp_bias=false",
                               "weight_quantization_calibration_method=absmax,0.9",
                               "act_quantization_calibration_method=fixed,-8,8",
                               "bwd_quantization_calibration_method=rms,3"])
  assert cfg.weight_quantization_calibration_method == "absmax,0.9"
  # Without quantization nothing reads them, so nothing refuses them.
  assert config.resolve_config(["model_name=deepseek3-tiny", "weight_quantization_calibration_method=minmax"])


def test_verbose_key_report():
  lines = config.describe_keys(["model_name=deepseek3-671b-batchsplit", "mtp_num_layers=1", "capacity_factor=1.0",
                                "dropout_rate=0.1", "ici_fsdp_parallelism=8"])
  text = "\n".join(lines)
  assert "shape the parameter tree: model_name, mtp_num_layers" in text
  assert "ignored for structure (used by forward, rules and export): capacity_factor" in text
  assert "dropout_rate (" in text and "ici_fsdp_parallelism" in text
  assert "set by model 'deepseek3-671b-batchsplit', ignored for structure:" in text and "use_batch_split_schedule" in text


def test_a_maxtext_command_line_pastes_verbatim():
  """The overrides of a MaxText training command (its base.yml argument included) resolve; ignored keys are kept."""
  command = ("src/maxtext/configs/base.yml base_output_directory=gs://bucket/runs run_name=v3 model_name=deepseek3-671b "
             "per_device_batch_size=4 steps=5 max_target_length=1024 async_checkpointing=false "
             "tokenizer_type=huggingface tokenizer_path=deepseek-ai/DeepSeek-V3 attention=flash megablox=False "
             "sparse_matmul=False scan_layers=True mtp_num_layers=1 mtp_loss_scaling_factor=0.1 dataset_type=synthetic "
             "ici_fsdp_parallelism=64 ici_expert_parallelism=4 remat_policy=custom opt_type=adamw "
             "learning_rate=2.2e-4 enable_checkpointing=false log_period=10 hardware=tpu")
  cfg = config.resolve_config(command.split())
  assert (cfg.model_name, cfg.mtp_num_layers, cfg.megablox, cfg.sparse_matmul) == ("deepseek3-671b", 1, False, False)
  assert (cfg.ici_fsdp_parallelism, cfg.learning_rate, cfg.tokenizer_path) == (64, 2.2e-4, "deepseek-ai/DeepSeek-V3")
