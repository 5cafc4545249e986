"""Discoverable CLI (issue 24): `presets`, `keys`, `topologies`, close-match preset names, shell completion.

References are MaxText's: its parameter listings (tests/data/listings), its base.yml keys and defaults
(tests/data/maxtext_0.2.5_base_keys.txt), and its slice sizes (utils/accelerator_to_spec_map.py, quoted below).
"""

import json
import math
import os
import re
import subprocess
import sys

import pytest
import yaml

import maxtext_listings
from inspect_tool import cli
from inspect_tool.sharding import mesh

from conftest import REPO
from conftest import DATA


def run(capsys, *argv):
  code = cli.main(list(argv))
  out, err = capsys.readouterr()
  return code, out, err


# ----------------------------------------------------------------------------------------------------------------
# presets


def _maxtext_preset_listings():
  """{preset: (mtp_num_layers, MaxText's listing file)} for listings of a preset as its file sets it."""
  out = {}
  for path in sorted(maxtext_listings.LISTINGS.glob("*_scan_mtp*.txt")):
    keys = dict(k.split("=", 1) for k in maxtext_listings.model_keys(path.name))
    if set(keys) <= {"model_name", "scan_layers", "mtp_num_layers"} and keys.get("scan_layers", "true") == "true":
      out[keys["model_name"]] = (int(keys.get("mtp_num_layers", 0)), path.name)
  return out


def test_presets_json_counts_each_preset_as_maxtext_lists_it(capsys):
  code, out, err = run(capsys, "presets", "--format", "json")
  assert code == 0, err
  rows = {r["name"]: r for r in json.loads(out)["presets"]}
  models = os.path.join(REPO, "inspect_tool", "configuration", "maxtext_data", "models")
  assert set(rows) == {f[:-4] for f in os.listdir(models) if f.endswith(".yml")}
  listed = _maxtext_preset_listings()
  assert len(listed) >= 9, listed
  for name, (mtp, filename) in listed.items():
    # MaxText's Params of the preset as it sets it (mtp_num_layers=0): its listing without the MTP block.
    expected = sum(math.prod(shape) for key, shape, _ in maxtext_listings.entries(filename) if ".mtp_block." not in key)
    assert rows[name]["parameters"] == expected, name
    if mtp:  # MaxText built it with mtp_num_layers=1
      assert rows[name]["mtp"] is True, name
  # MaxText 0.2.5 refuses MTP with the DeepSeek4 block ("currently does not support MTP layers").
  assert [n for n, r in rows.items() if r["decoder_block"] == "deepseek4"] == ["deepseek4-284b", "deepseek4-tiny"]
  assert not rows["deepseek4-tiny"]["mtp"] and "does not support MTP" in rows["deepseek4-tiny"]["note"]
  # MaxText lists deepseek-custom only with override_model_config=true engram_layers=[] (line 1 of its listing).
  assert rows["deepseek-custom"]["parameters"] is None and "engram_layers" in rows["deepseek-custom"]["note"]
  assert rows["deepseek3-671b"]["description"].startswith("61 layers (3 dense), 256 experts (8 active, 1 shared)")


def test_presets_text_is_one_row_per_preset(capsys):
  code, out, _ = run(capsys, "presets")
  lines = out.splitlines()
  assert code == 0 and lines[0].split()[:4] == ["preset", "decoder/attention", "params", "MTP"]
  row = next(line for line in lines if line.startswith("deepseek3-671b "))
  assert row.split()[1:4] == ["deepseek/mla", "671.03B", "yes"]


@pytest.mark.parametrize("given,meant", [("deepseek3-671", "deepseek3-671b"), ("DeepSeek3-671B", "deepseek3-671b"),
                                         ("deepseek3-tiny2", "deepseek3-tiny"), ("kimi-k2", "kimi-k2-1t")])
def test_a_misspelt_preset_gets_one_suggestion(capsys, given, meant):
  code, out, err = run(capsys, "maxtext", f"model_name={given}")
  assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
  assert f"did you mean '{meant}'?" in err and "deepseek2-16b" not in err


def test_an_unlike_preset_name_still_gets_the_list(capsys):
  code, _, err = run(capsys, "maxtext", "model_name=deepseek3")  # ambiguous: six presets begin so
  assert code == 2 and "did you mean" not in err and "known: deepseek-custom, deepseek2-16b" in err


# ----------------------------------------------------------------------------------------------------------------
# keys


def _maxtext_defaults():
  with open(os.path.join(DATA, "maxtext_0.2.5_base_keys.txt"), encoding="utf-8") as f:
    return yaml.safe_load(f.read())


def test_keys_lists_every_maxtext_key_with_its_default(capsys):
  code, out, _ = run(capsys, "keys", "--format", "json")
  data = json.loads(out)
  rows = {r["key"]: r for r in data["keys"]}
  maxtext = _maxtext_defaults()
  assert code == 0 and set(maxtext) <= set(rows)
  assert set(rows) - set(maxtext) == {r for r in rows if "this tool's key" in rows[r]["note"]}
  assert set(data["affects"]) == {"tree", "forward", "rules", "sharding", "ignored", "refused"}
  for key, default in maxtext.items():
    default = None if default == "None" else default
    if "MaxText's default" not in rows[key]["note"]:
      got = rows[key]["default"]
      assert got == default or (isinstance(default, float) and got == pytest.approx(default)), key
  assert rows["use_qwix_quantization"]["note"] == "MaxText's default: false"  # this tool always models Qwix


def test_keys_pattern_filters_by_name(capsys):
  code, out, _ = run(capsys, "keys", "mtp", "--format", "json")
  names = [r["key"] for r in json.loads(out)["keys"]]
  assert code == 0 and names == sorted(k for k in _maxtext_defaults() if "mtp" in k)
  code, out, _ = run(capsys, "keys", "^ici_.*_parallelism$")
  body = out.split("\n\n")[0].splitlines()[1:]
  assert code == 0 and len(body) == sum(bool(re.match("^ici_.*_parallelism$", k)) for k in _maxtext_defaults())
  assert {line.split()[2] for line in body} == {"sharding", "refused"}  # ici_pipeline_parallelism: refused
  code, out, err = run(capsys, "keys", "(a|a)*z")
  assert code == 2 and out == "" and "backtrack" in err and len(err.strip().splitlines()) == 1


def _affects():
  from inspect_tool.configuration import catalog  # pylint: disable=import-outside-toplevel
  return {r.key: r.affects for r in catalog.key_rows()}


def test_every_key_the_sharding_plan_or_the_rules_read_is_classified_so():
  """Scans the code that reads the config: a key read there must not be listed as ignored."""
  affects = _affects()
  read = set()
  for root, _, files in os.walk(os.path.join(REPO, "inspect_tool", "sharding")):
    for name in files:
      if name.endswith(".py"):
        with open(os.path.join(root, name), encoding="utf-8") as f:
          text = f.read()
        read |= set(re.findall(r"\bcfg\.([a-z][a-z0-9_]*)", text))
        read |= set(re.findall(r"passthrough\.get\(\"([a-z0-9_]+)\"", text))
        for prefix, suffix in re.findall(r"getattr\(cfg, f\"(dcn|ici)_\{[a-z]+\}_(parallelism)\"\)", text):
          read |= {k for k in affects if k.startswith(prefix + "_") and k.endswith("_parallelism")}
  read &= set(affects)  # properties (emb_dim, ...) are not keys
  assert len(read) > 25
  assert not {k: affects[k] for k in read if affects[k] in ("ignored",)}
  with open(os.path.join(REPO, "quant", "rules.py"), encoding="utf-8") as f:
    rules_read = set(re.findall(r"\bs\.([a-z][a-z0-9_]*)", f.read())) & set(affects)
  assert len(rules_read) >= 10 and {affects[k] for k in rules_read} == {"rules"}


def _listing(capsys, *extra):
  code, out, err = run(capsys, "maxtext", "model_name=deepseek3-tiny", "mtp_num_layers=1", "--devices", "4",
                       "--format", "json", *extra)
  assert code == 0, err
  data = json.loads(out)
  return [(p["key"], p["shape"], p["spec"]) for p in data["parameters"]]


def test_what_keys_says_a_key_affects_is_what_it_changes(capsys):
  affects = _affects()
  plain = _listing(capsys)
  assert affects["base_emb_dim"] == "tree"
  assert [p[1] for p in _listing(capsys, "override_model_config=true", "base_emb_dim=128")] != [p[1] for p in plain]
  assert affects["ici_expert_parallelism"] == "sharding"
  sharded = _listing(capsys, "ici_expert_parallelism=4", "ici_fsdp_parallelism=1")
  assert [p[:2] for p in sharded] == [p[:2] for p in plain] and sharded != plain
  assert affects["run_name"] == affects["dropout_rate"] == "ignored" and affects["capacity_factor"] == "forward"
  assert _listing(capsys, "run_name=r1", "dropout_rate=0.1", "capacity_factor=2") == plain
  assert affects["quantize_logits_proj"] == "rules"
  base = ["rules", "model_name=deepseek3-tiny", "quantization=fp8_full", "--format", "json"]
  _, without, _ = run(capsys, *base)
  _, with_logits, _ = run(capsys, *base, "quantize_logits_proj=true")
  assert json.loads(without)["rules"] != json.loads(with_logits)["rules"]
  assert affects["mlp_bias"] == "refused"
  code, _, err = run(capsys, "maxtext", "model_name=deepseek3-tiny", "mlp_bias=true")
  assert code == 2 and "mlp_bias=True is not supported" in err


# ----------------------------------------------------------------------------------------------------------------
# topologies

# MaxText 0.2.5 utils/accelerator_to_spec_map.py: devices_per_slice of a few slices (v4/v5p: chips; a3: 8 GPUs).
MAXTEXT_SLICES = {"v4-8": 4, "v5p-8": 4, "v5p-256": 128, "v5e-256": 256, "v6e-64": 64, "tpu7x-2": 2, "a3": 8}


def test_topologies_lists_maxtexts_slices_with_their_chips_memory(capsys):
  code, out, _ = run(capsys, "topologies", "--format", "json")
  rows = {r["name"]: r for r in json.loads(out)["topologies"]}
  assert code == 0 and {n: rows[n]["devices"] for n in MAXTEXT_SLICES} == MAXTEXT_SLICES
  assert rows["a3"]["platform"] == "gpu" and rows["v5p-8"]["platform"] == "tpu"
  assert set(rows) == set(mesh.topologies())
  # Per-chip memory from the vendors' pages: v5p 95 GiB (TPU v5p), H100 SXM 80 GB (a3 is 8 H100s).
  assert (rows["v5p-256"]["chip"], rows["v5p-256"]["hbm_per_device"]) == ("v5p", "95GiB")
  assert (rows["a3"]["chip"], rows["a3"]["hbm_per_device"]) == ("h100", "80GB")
  assert rows["h100"]["devices"] is None  # a chip's name alone: the count comes from --devices
  code, out, _ = run(capsys, "topologies")
  assert code == 0 and out.splitlines()[0].split() == ["topology", "devices/slice", "platform", "chip",
                                                       "memory/device"]
  assert re.search(r"^v5p-256 +128 +tpu +v5p +95GiB$", out, re.M) and re.search(r"^h100 +- +gpu", out, re.M)


# ----------------------------------------------------------------------------------------------------------------
# shell completion (Click's): `eval "$(_INSPECT_CHECKPOINT_COMPLETE=bash_source inspect_checkpoint)"`


def _complete(**env):
  result = subprocess.run([sys.executable, "-m", "inspect_tool"], capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, **env}, check=False, timeout=120)
  assert result.returncode == 0, result.stderr
  return result.stdout


def test_shell_completion_scripts_and_completions():
  script = _complete(_INSPECT_CHECKPOINT_COMPLETE="bash_source")
  assert "complete -o nosort -F _inspect_checkpoint_completion inspect_checkpoint" in script
  assert _complete(_INSPECT_CHECKPOINT_COMPLETE="zsh_source").startswith("#compdef inspect_checkpoint")
  assert _complete(_INSPECT_CHECKPOINT_COMPLETE="bash_complete", COMP_WORDS="inspect_checkpoint to",
                   COMP_CWORD="1").split() == ["plain,topologies"]
  assert "plain,--strict" in _complete(_INSPECT_CHECKPOINT_COMPLETE="bash_complete",
                                       COMP_WORDS="inspect_checkpoint rules --st", COMP_CWORD="2").split()
  # bash splits model_name=deepseek3-6 at '=': the value is completed on its own
  assert _complete(_INSPECT_CHECKPOINT_COMPLETE="bash_complete", COMP_WORDS="inspect_checkpoint maxtext "
                   "model_name = deepseek3-6", COMP_CWORD="4").split() == [
                       "plain,deepseek3-671b", "plain,deepseek3-671b-2dfsdp", "plain,deepseek3-671b-batchsplit"]
