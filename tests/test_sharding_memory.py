"""Per-device memory and the `maxtext --devices` command line, checked against MaxText's shard shapes."""

import json
import math
import os

import pytest

from inspect_tool import cli
from inspect_tool.configuration import config
from inspect_tool.paramtree import params
from inspect_tool import model as model_lib
from inspect_tool.report import html
from inspect_tool.sharding import memory, placement
from inspect_tool.sharding import mesh as mesh_lib
from test_sharding import DATA, read_reference

TINY = ["model_name=deepseek3-tiny", "mtp_num_layers=1", "ici_fsdp_parallelism=4", "ici_expert_parallelism=2"]


def _reference_param_elements(name):
  """Elements one device holds of every Param (the gate bias is not a Param), from MaxText's shard shapes."""
  _, _, _, variables = read_reference(os.path.join(DATA, name))
  shards = {k: math.prod(shard) for k, (_, _, shard, _) in variables.items() if not k.endswith("gate.bias")}
  return sum(shards.values()), shards


def _memory(keys, devices, **kwargs):
  cfg = config.resolve_config(keys)
  leaves = params.param_leaves(model_lib.build_model(cfg, abstract=True))
  return memory.device_memory(leaves, placement.plan(leaves, cfg, devices), cfg, **kwargs)


@pytest.mark.parametrize("optimizer, bytes_per_element", [(None, 4), ("sgd", 8), ("adamw", 16), ("adam_pax", 16)])
def test_671b_per_device_bytes_equal_maxtext_shards_times_dtype(optimizer, bytes_per_element):
  elements, _ = _reference_param_elements("671b_fsdp32_ep8.txt")
  mem = _memory(["model_name=deepseek3-671b", "mtp_num_layers=1", "ici_fsdp_parallelism=32",
                 "ici_expert_parallelism=8"], 256, optimizer=optimizer)
  assert mem.total.total == elements * bytes_per_element
  assert mem.total.params == elements * 4
  assert sum(r.total for r in mem.rows if not r.part) == mem.total.total


def test_bf16_weights_mu_inherits_the_weight_dtype_unless_mu_dtype_is_set():
  elements, _ = _reference_param_elements("tiny_fsdp4_ep2.txt")
  bf16 = _memory([*TINY, "weight_dtype=bfloat16"], 8, optimizer="adamw")
  assert (bf16.total.params, bf16.total.optimizer, bf16.total.gradients) == (2 * elements, 4 * elements,
                                                                            2 * elements)
  mixed = _memory([*TINY, "weight_dtype=bfloat16", "mu_dtype=float32"], 8, optimizer="adamw")
  assert mixed.total.optimizer == (4 + 2) * elements and mixed.mu_dtype == "float32"


def test_opt_type_in_the_config_turns_on_training_memory_and_muon_is_refused():
  cfg = config.resolve_config([*TINY, "opt_type=adam_pax"])
  assert memory.optimizer_of(cfg, None) == "adam_pax"
  assert memory.optimizer_of(config.resolve_config(TINY), None) is None
  with pytest.raises(mesh_lib.ShardingError, match="muon"):
    memory.optimizer_of(config.resolve_config([*TINY, "opt_type=muon"]), None)
  with pytest.raises(mesh_lib.ShardingError, match="shard_optimizer_over_data"):
    memory.optimizer_of(config.resolve_config([*TINY, "shard_optimizer_over_data=true"]), "adamw")


def test_device_memory_sizes():
  assert memory.parse_bytes("95GiB") == 95 * 2**30
  assert memory.parse_bytes("80GB") == 80 * 10**9
  assert memory.parse_bytes("1.5 TiB") == int(1.5 * 2**40)
  for bad in ("0GB", "95XB", "lots", "-1GiB"):
    with pytest.raises(mesh_lib.ShardingError, match="--device-memory"):
      memory.parse_bytes(bad)


def run(capsys, *argv):
  code = cli.main(list(argv))
  out, err = capsys.readouterr()
  return code, out, err


def test_text_lines_are_maxtext_lines(capsys):
  code, out, _ = run(capsys, "maxtext", *TINY, "--devices", "8", "--check_dtype", "--all")
  assert code == 0
  with open(os.path.join(DATA, "tiny_fsdp4_ep2.txt"), encoding="utf-8") as f:
    expected = f.read().splitlines()[1:]
  ours = {line.split(" | ")[0].split(".", 2)[2]: line.split(" | ", 1)[1] for line in out.splitlines()
          if line.startswith("key: ")}
  assert ours == {line.split(" | ")[0][len("key: "):]: line.split(" | ", 1)[1] for line in expected}


def test_json_spec_has_one_item_per_dimension(capsys):
  code, out, _ = run(capsys, "maxtext", *TINY, "--devices", "8", "--format", "json", "--train", "adamw")
  assert code == 0
  doc = json.loads(out)
  entry = {p["key"]: p for p in doc["parameters"]}
  wi = entry["params.params.decoder.moe_layers.DeepSeekMoeBlock_0.MoeBlock_0.wi_0"]
  assert wi["spec"] == ["expert", None, "fsdp", None] and wi["shard_shape"] == [8, 58, 16, 64]
  emb = entry["params.params.token_embedder.embedding"]
  assert emb["spec"] == [None, ["fsdp", "expert"]] and emb["shard_shape"] == [129280, 8]
  assert all(len(p["spec"]) == len(p["shape"]) for p in doc["parameters"])
  assert doc["sharding"]["devices"] == 8 and doc["sharding"]["mesh"]["fsdp"] == 4
  elements, _ = _reference_param_elements("tiny_fsdp4_ep2.txt")
  assert doc["device_memory"]["largest_device_bytes"] == 16 * elements


def test_markdown_has_spec_columns_and_memory_table(capsys):
  code, out, _ = run(capsys, "maxtext", *TINY, "--devices", "8", "--format", "markdown")
  assert code == 0
  assert "| key | shape | dtype | spec | shard |" in out and "## Per-device memory" in out
  assert "| `params.params.token_embedder.embedding` | (129280, 64) | float32 | `P(None, ('fsdp', 'expert'))` | " \
         "(129280, 8) |" in out


def test_device_memory_too_small_exits_1_naming_the_largest_contributor(capsys):
  elements, shards = _reference_param_elements("tiny_fsdp4_ep2.txt")
  largest = max(shards, key=shards.get)
  # Parameters only (no --train: no activation estimate either): 4 bytes per element.
  code, out, err = run(capsys, "maxtext", *TINY, "--devices", "8", "--summary", "--device-memory",
                       f"{4 * elements - 1}B")
  assert code == 1 and "DOES NOT FIT" in out
  assert len(err.strip().splitlines()) == 1 and "does not fit" in err and f"params.params.{largest}" in err
  code, out, _ = run(capsys, "maxtext", *TINY, "--devices", "8", "--summary", "--device-memory", f"{4 * elements}B")
  assert code == 0 and "fits" in out


@pytest.mark.parametrize("argv, words", [
    (["--devices", "8", "ici_fsdp_parallelism=3"], ["ici_fsdp_parallelism=3"]),
    (["--topology", "v9-8"], ["topology 'v9-8'"]),
    (["--devices", "4", "--topology", "v6e-8"], ["disagrees"]),
    (["--device-memory", "9GB"], ["--devices"]),
])
def test_bad_mesh_input_is_one_line_exit_2(capsys, argv, words):
  code, out, err = run(capsys, "maxtext", "model_name=deepseek3-tiny", "mtp_num_layers=1", *argv)
  assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
  assert all(w in err for w in words), err


def test_html_shows_spec_beside_each_leaf():
  cfg = config.resolve_config(TINY)
  model = model_lib.build_model(cfg, abstract=True)
  plan = placement.plan(params.param_leaves(model), cfg, 8)
  page = html.render_model_html(model, title="t", sharding=plan)
  assert "P((&#x27;fsdp&#x27;, &#x27;expert&#x27;), None) → f32[8,64]" in page
