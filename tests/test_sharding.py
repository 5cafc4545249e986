"""Spec and shard shape of every variable against MaxText 0.2.5's own sharding (tests/data/sharding/)."""

import ast
import glob
import json
import math
import os
import re

import pytest

import maxtext_listings

from inspect_tool import cli
from inspect_tool import errors
from inspect_tool.configuration import config
from inspect_tool.paramtree import params
from inspect_tool.paramtree import tree
from inspect_tool import model as model_lib
from inspect_tool.sharding import mesh as mesh_lib
from inspect_tool.sharding import placement, rules

from conftest import DATA as DATA_DIR
DATA = os.path.join(DATA_DIR, "sharding")
REFERENCES = sorted(f for f in glob.glob(os.path.join(DATA, "*.txt")) if not f.endswith("refusals.txt"))
_HEADER = re.compile(r"# mesh (\{.*\}) devices (\d+) overrides (.*)")


def read_reference(path):
  """(mesh dict, device count, keys, {module path: (shape, spec text, shard shape, dtype)}) of a MaxText file."""
  with open(path, encoding="utf-8") as f:
    lines = f.read().splitlines()
  header = _HEADER.fullmatch(lines[0])
  variables = {}
  for line in lines[1:]:
    fields = dict(part.split(": ", 1) for part in line.split(" | "))
    variables[fields["key"]] = (ast.literal_eval(fields["shape"]), fields["spec"],
                                ast.literal_eval(fields["shard"]), fields["dtype"])
  return ast.literal_eval(header.group(1)), int(header.group(2)), header.group(3).split(), variables


def _abstract_leaves(cfg):
  return params.param_leaves(model_lib.build_model(cfg, abstract=True), include_non_params=True)


@pytest.mark.parametrize("path", REFERENCES, ids=[os.path.basename(p)[:-4] for p in REFERENCES])
def test_every_variable_is_sharded_as_maxtext_shards_it(path):
  mesh_shape, devices, keys, expected = read_reference(path)
  cfg = config.resolve_config(keys)
  leaves = _abstract_leaves(cfg)
  plan = placement.plan(leaves, cfg, devices)
  assert plan.mesh.shape == mesh_shape
  got = {}
  for leaf in leaves:
    place = plan.of(leaf)
    got[".".join(leaf.module_path)] = (leaf.shape, place.spec_text(), place.shard_shape, leaf.dtype)
  assert set(got) == set(expected)
  wrong = {k: (got[k], expected[k]) for k in expected if got[k] != expected[k]}
  assert not wrong


def test_reference_set_exercises_sharded_heads_norms_and_gate_bias():
  """The references are not all alike: tensor parallelism shards norms and heads; the gate bias is present."""
  _, _, _, tp = read_reference(os.path.join(DATA, "tiny_fsdp2_tp4.txt"))
  assert tp["decoder.decoder_norm.scale"][1] == "P('tensor',)"
  assert tp["decoder.moe_layers.DeepSeekMoeBlock_0.MoeBlock_0.gate.bias"][1] == "P(None, None)"
  _, _, _, big = read_reference(os.path.join(DATA, "671b_fsdp32_ep8.txt"))
  assert big["decoder.moe_layers.DeepSeekMoeBlock_0.MoeBlock_0.wi_0"][1:3] == ("P('expert', None, 'fsdp', None)",
                                                                              (32, 58, 224, 2048))


def _tiny(*keys):
  return config.resolve_config(["model_name=deepseek3-tiny", "mtp_num_layers=1", *keys])


@pytest.mark.parametrize("keys, devices, words", [
    (["dcn_fsdp_parallelism=2"], 8, ["dcn_fsdp_parallelism=2", "only one slice"]),
    (["ici_fsdp_parallelism=3"], 8, ["ici_fsdp_parallelism=3", "8 devices per slice"]),
    (["ici_tensor_parallelism=-1"], 8, ["only one axis may be -1", "ici_fsdp_parallelism", "ici_tensor_parallelism"]),
    (["ici_fsdp_parallelism=-1", "ici_tensor_parallelism=3"], 8, ["cannot be resolved", "8"]),
    (["mesh_axes=['data','fsdpp']"], 8, ["unknown axis 'fsdpp'", "fsdp_transpose"]),
])
def test_meshes_maxtext_refuses_are_refused_in_one_line(keys, devices, words):
  cfg = _tiny(*keys)
  with pytest.raises(mesh_lib.ShardingError) as e:
    mesh_lib.build_mesh(cfg, devices)
  message = str(e.value)
  assert "\n" not in message and all(w in message for w in words), message


@pytest.mark.parametrize("key", ["ici_pipeline_parallelism", "dcn_pipeline_parallelism"])
def test_pipeline_parallelism_is_refused_for_every_command(key):
  """MaxText stacks the decoder layers by pipeline stage (another parameter tree): refused when the config is read."""
  with pytest.raises(errors.ConfigError) as e:
    _tiny(f"{key}=2", "ici_fsdp_parallelism=4")
  assert str(e.value) == (f"{key}=2 is not supported: in MaxText it wraps the decoder layers in a pipeline module "
                          "(parameters stacked by stage), which this tool does not model; accepted: 1 (MaxText's "
                          "default)")


def test_indivisible_dimension_is_refused_naming_the_parameter():
  """MaxText/JAX: IndivisibleError for kv_lora (16) over fsdp=32 (refusals.txt); no silent replication."""
  with open(os.path.join(DATA, "refusals.txt"), encoding="utf-8") as f:
    assert "IndivisibleError" in f.read()
  cfg = _tiny("ici_fsdp_parallelism=32")
  with pytest.raises(mesh_lib.ShardingError) as e:
    placement.plan(_abstract_leaves(cfg), cfg, 32)
  assert "wkv_b.kernel (16, 3, 4, 256): dimension 0 (16) is not divisible by 32" in str(e.value)


def test_multislice_mesh_multiplies_ici_by_dcn():
  cfg = _tiny("num_slices=2", "ici_fsdp_parallelism=4", "ici_expert_parallelism=2")
  mesh = mesh_lib.build_mesh(cfg, 16)
  assert mesh.shape["data"] == 2 and mesh.shape["fsdp"] == 4 and mesh.devices == 16  # dcn_data -1 → 2 slices


def test_topology_names_give_maxtext_devices_per_slice():
  assert mesh_lib.topology_devices("v5p-256") == 128  # v5p counts TensorCores, two per chip
  assert mesh_lib.topology_devices("v6e-64") == 64
  assert mesh_lib.topology_devices("a3") == 8


def test_rule_priority_falls_back_to_a_later_duplicate_when_axes_collide():
  """Flax's order: `mlp` takes fsdp_transpose first, so the first `embed` rule collides and the second serves."""
  rule_list = rules.normalize_rules([["mlp", ["fsdp_transpose", "tensor"]], ["embed", ["fsdp", "fsdp_transpose"]],
                                     ["embed", ["fsdp", "expert"]]])
  assert rules.logical_to_mesh(("embed", "mlp"), rule_list) == [("fsdp", "expert"), ("fsdp_transpose", "tensor")]
  mesh = mesh_lib.Mesh(("fsdp", "fsdp_transpose", "tensor", "expert"), (4, 1, 2, 1))
  assert rules.spec_for(("embed", "mlp"), rule_list, mesh) == ("fsdp", "tensor")


def test_merge_replaces_rules_of_the_same_name_and_appends():
  base = (("a", ("x",)), ("b", ("y",)), ("a", ("z",)))
  assert rules.merge_rules(base, (("a", ("w",)),)) == (("b", ("y",)), ("a", ("w",)))


def test_rule_naming_an_axis_the_mesh_lacks_is_refused():
  cfg = _tiny("logical_axis_rules=[['embed', ['fsdp', 'fsdpp']]]")
  leaves = [tree.Leaf(tree.param_key(("token_embedder", "embedding")), (129280, 64), "float32")]
  with pytest.raises(mesh_lib.ShardingError, match="'fsdpp'"):
    placement.plan(leaves, cfg, 8)


FAMILY_MEMORY = [  # (MaxText's sharding, MaxText's listing of the same model: its nnx.Params)
    ("v4tiny_fsdp4_ep2.txt", "deepseek4-tiny_scan_mtp0.txt"),
    ("v4_284b_fsdp32_ep8.txt", "deepseek4-284b_scan_mtp0.txt"),
    ("custom_mtp1_fsdp4_ep2.txt", "deepseek-custom_scan_mtp1.txt"),
]


@pytest.mark.parametrize("reference, listing", FAMILY_MEMORY, ids=[r[:-4] for r, _ in FAMILY_MEMORY])
def test_family_training_memory_is_maxtext_shards_of_its_params(reference, listing, capsys):
  """`--summary --train adamw --device-memory 16GiB`: params + adamw's mu, nu + gradients, all float32, of every
  nnx.Param MaxText lists, at MaxText's per-device shard shapes (V4's gate bias and tid2eid are not Params)."""
  _, devices, keys, variables = read_reference(os.path.join(DATA, reference))
  listed = {key.split(".", 2)[2] for key, _, _ in maxtext_listings.entries(listing)}
  assert listed <= set(variables)
  elements = sum(math.prod(variables[key][2]) for key in listed)
  code = cli.main(["maxtext", *keys, "--devices", str(devices), "--summary", "--train", "adamw",
                   "--device-memory", "16GiB", "--format", "json"])
  out = capsys.readouterr().out
  memory = json.loads(out)["device_memory"]
  assert memory["total"]["params_bytes"] == 4 * elements
  assert memory["largest_device_bytes"] == 16 * elements
  # The verdict adds the activation estimate (tests/test_activations.py) to these exact bytes.
  needed = 16 * elements + memory["activations"]["total_bytes"]
  assert memory["needed_bytes"] == needed
  assert code == (0 if needed <= 16 * 2**30 else 1) and memory["fits"] == (code == 0)


def test_v4_tensor_parallelism_is_refused_as_maxtext_refuses_it():
  """MaxText: IndivisibleError for wkv (64, 1, 32) on P(('fsdp', 'expert'), 'tensor', None) (its one KV head)."""
  with open(os.path.join(DATA, "README.md"), encoding="utf-8") as f:
    assert "P(('fsdp', 'expert'), 'tensor', None)` on shape (64, 1, 32)" in f.read()
  cfg = config.resolve_config(["model_name=deepseek4-tiny", "scan_layers=false", "ici_fsdp_parallelism=2",
                               "ici_tensor_parallelism=2", "ici_expert_parallelism=2"])
  with pytest.raises(mesh_lib.ShardingError) as e:
    placement.plan(_abstract_leaves(cfg), cfg, 8)
  assert "self_attention.wkv.kernel (64, 1, 32): dimension 1 (1) is not divisible by 2" in str(e.value)
