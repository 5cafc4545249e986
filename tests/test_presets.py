"""Every DeepSeek-family preset against MaxText 0.2.5's own listings (scanned and unscanned), totals included.

The references in tests/data/listings/ were written by MaxText itself (see its README.md); line 1 of each is the
MaxText command, whose key=value overrides are given to our tool unchanged.
"""

import math
import re

import maxtext_listings
import pytest

from inspect_tool.configuration import config
from inspect_tool.listings import model_listing
from inspect_tool.configuration import presets
from inspect_tool.report import listing


def _model_of(name: str) -> str:
  """The model_name of MaxText's command that wrote listing `name`."""
  return next(t.split("=", 1)[1] for t in maxtext_listings.model_keys(name) if t.startswith("model_name="))


# MaxText's listings of the DeepSeek-family presets and the `Total Parameters` MaxText printed with each
# (tests/data/listings/README.md). deepseek3-671b, -tiny, -test and deepseek2-16b: tests/test_model_params.py.
CASES = {
    "deepseek2-236b_scan_mtp1.txt": 239765995520,
    "deepseek2-236b_noscan_mtp1.txt": 239765995520,
    "deepseek3-671b-2dfsdp_scan_mtp1.txt": 682636472320,
    "deepseek3-671b-2dfsdp_noscan_mtp1.txt": 682636472320,
    "deepseek3-671b-batchsplit_scan_mtp1.txt": 682636472320,
    "deepseek3-671b-batchsplit_noscan_mtp1.txt": 682636472320,
    "deepseek3-test_noscan_mtp1.txt": 16118181888,
    "kimi-k2-1t_scan_mtp1.txt": 1043570356224,
    "kimi-k2-1t_noscan_mtp1.txt": 1043570356224,
}
# The presets of MaxText's DeepSeek V2/V3 family (issue 9); newer architectures test their own presets.
FAMILY = ("deepseek2-16b", "deepseek2-236b", "deepseek3-671b", "deepseek3-671b-2dfsdp", "deepseek3-671b-batchsplit",
          "deepseek3-test", "deepseek3-tiny", "kimi-k2-1t")


def test_every_family_preset_is_built_and_has_a_scanned_and_an_unscanned_maxtext_listing():
  assert set(FAMILY) <= set(presets.names())
  listed = {(_model_of(n), "_noscan_" in n) for n in (p.name for p in maxtext_listings.LISTINGS.iterdir())
            if re.fullmatch(r".+_(no)?scan_mtp\d\.txt", n)}
  for name in FAMILY:
    assert (name, False) in listed and (name, True) in listed, name


@pytest.mark.parametrize("name,total", sorted(CASES.items()))
def test_listing_is_maxtexts(name, total):
  want = [line for line in (maxtext_listings.LISTINGS / name).read_text().splitlines() if line.startswith("key: ")]
  report, _ = model_listing.model_listing(config.resolve_config(maxtext_listings.model_keys(name)))
  assert listing.listing_lines(report, check_dtype=True) == want  # names, shapes, dtypes and MaxText's order
  params = [shape for key, shape, _ in maxtext_listings.entries(name) if key.startswith("params.params.")]
  assert report.summary.total_params == sum(math.prod(shape) for shape in params) == total


def test_kimi_total():
  report, _ = model_listing.model_listing(config.resolve_config(["model_name=kimi-k2-1t", "mtp_num_layers=1"]))
  assert report.summary.total_params == 1_043_570_356_224


def test_presets_hold_maxtexts_model_keys():
  """A preset file sets exactly what MaxText's model YAML sets (spot checks of values read from MaxText's files)."""
  kimi = presets.load("kimi-k2-1t")
  assert (kimi["num_experts"], kimi["rope_max_timescale"], kimi["beta_fast"], kimi["routed_scaling_factor"]) == (
      384, 50000, 1, 2.827)
  batchsplit = config.resolve_config(["model_name=deepseek3-671b-batchsplit"])
  assert (batchsplit.n_routing_groups, batchsplit.topk_routing_group) == (8, 4)
  assert batchsplit.use_batch_split_schedule is True and batchsplit.shard_mode == "explicit"
  assert batchsplit.mesh_axes == ["data", "fsdp", "expert", "context"]
  fsdp2d = config.resolve_config(["model_name=deepseek3-671b-2dfsdp"])
  assert ["embed_vocab", ["fsdp", "fsdp_transpose"]] in fsdp2d.logical_axis_rules


def test_every_deepseek_family_name_of_maxtext_is_built_or_refused_as_not_built():
  family = [n for n in presets.maxtext_model_names() if n.startswith(presets.FAMILY_PREFIXES)]
  assert len(family) == 12
  for name in family:
    assert name in presets.names() or name in presets.NOT_BUILT, name


def test_a_family_name_not_built_yet_is_refused_in_one_line(monkeypatch):
  monkeypatch.setattr(presets, "NOT_BUILT", {"deepseek9-tiny": "DeepSeek-V9"})
  with pytest.raises(config.errors.ConfigError) as info:
    config.resolve_config(["model_name=deepseek9-tiny"])
  message = str(info.value)
  assert "support for the DeepSeek-V9 architecture is not built yet" in message and "kimi-k2-1t" in message
  assert "\n" not in message


def test_cli_refuses_a_non_deepseek_maxtext_model_in_one_line(capsys):
  from inspect_tool import cli  # pylint: disable=import-outside-toplevel

  code = cli.main(["maxtext", "model_name=llama3-8b"])
  out, err = capsys.readouterr()
  assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
  assert "'llama3-8b' is a MaxText model outside the DeepSeek family" in err
  assert ", ".join(presets.names()) in err


def test_cli_json_echoes_ignored_keys_and_they_do_not_change_the_listing(capsys):
  import json  # pylint: disable=import-outside-toplevel

  from inspect_tool import cli  # pylint: disable=import-outside-toplevel

  base = ["maxtext", "model_name=deepseek3-tiny", "mtp_num_layers=1", "--format", "json"]
  assert cli.main(base) == 0
  plain = json.loads(capsys.readouterr().out)
  extra = ["ici_fsdp_parallelism=4", "mesh_axes=[data,fsdp]", "opt_type=sgd", "run_name=r1",
           "use_batch_split_schedule=true", "dropout_rate=0.1"]
  assert cli.main(base + extra) == 0
  echoed = json.loads(capsys.readouterr().out)
  assert echoed["parameters"] == plain["parameters"] and echoed["total_parameters"] == plain["total_parameters"]
  assert {k: echoed["config"][k] for k in ("ici_fsdp_parallelism", "mesh_axes", "opt_type", "run_name",
                                           "use_batch_split_schedule", "dropout_rate")} == {
      "ici_fsdp_parallelism": 4, "mesh_axes": ["data", "fsdp"], "opt_type": "sgd", "run_name": "r1",
      "use_batch_split_schedule": True, "dropout_rate": 0.1}
  assert "ici_fsdp_parallelism" not in plain["config"] and plain["config"]["model_name"] == "deepseek3-tiny"


def test_cli_verbose_lists_the_keys_ignored_for_structure(capsys):
  from inspect_tool import cli  # pylint: disable=import-outside-toplevel

  assert cli.main(["maxtext", "model_name=deepseek3-tiny", "dropout_rate=0.1", "capacity_factor=2",
                   "opt_type=sgd", "--verbose"]) == 0
  err = capsys.readouterr().err
  assert "shape the parameter tree: model_name" in err
  assert "ignored for structure (used by forward, rules and export): capacity_factor" in err
  assert "ignored for structure and by the forward pass: dropout_rate" in err
  assert "kept in --format json's config): opt_type" in err
