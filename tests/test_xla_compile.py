"""`--compile`: the training step and the forward pass compiled for a TPU topology on this CPU host by libtpu (no
TPU), XLA's per-device memory against MaxText 0.2.5's own `train_compile` (tests/data/xla_ref/, made by MaxText with
libtpu 0.0.50.1 on this host: see tests/data/README.md), the Pallas kernels under fp8_full, and the verdict.

libtpu is declared by the `tpu` extra for both stacks (`make stack` installs it): these tests fail, never skip, when it
is missing (`test_libtpu_is_installed_where_declared`), and every compile here needs it.
"""

import importlib.metadata
import json
import pathlib
import subprocess
import sys

import pytest

from inspect_tool.cli import main
from inspect_tool.host import accelerator
from inspect_tool.xla_compile import libtpu
from inspect_tool.xla_compile import memory

from conftest import DATA
from conftest import REPO as REPO_DIR
REPO = pathlib.Path(REPO_DIR)
REF = pathlib.Path(DATA) / "xla_ref"
TINY = ["model_name=deepseek3-tiny", "mtp_num_layers=1", "per_device_batch_size=1", "max_target_length=256"]
L4 = ["model_name=deepseek3-tiny", "mtp_num_layers=1", "override_model_config=true", "base_num_decoder_layers=4",
      "first_num_dense_layers=1", "vocab_size=1024", "per_device_batch_size=1", "max_target_length=256"]


def _cli(*argv):
  result = subprocess.run([sys.executable, "-m", "inspect_tool", *argv], capture_output=True, text=True, cwd=REPO,
                          timeout=900, check=False)
  return result.returncode, result.stdout, result.stderr


def _json(*argv):
  code, out, err = _cli(*argv, "--format", "json")
  assert code in (0, 1), err
  return code, json.loads(out), err


@pytest.fixture(scope="module")
def tiny_train():
  """deepseek3-tiny with MTP, its AdamW training step on v5p-8: MaxText's case of tests/data/xla_ref."""
  return _json("maxtext", *TINY, "--topology", "v5p-8", "--compile", "--train", "adamw")


def test_libtpu_is_installed_where_declared():
  """The `tpu` extra declares libtpu for this Python (its marker): it must be installed, at JAX's own pin."""
  declared = [r for r in importlib.metadata.requires("inspect-checkpoint") or ()
              if r.startswith("libtpu") and 'extra == "tpu"' in r]
  from packaging.requirements import Requirement  # pylint: disable=import-outside-toplevel
  here = [Requirement(r) for r in declared if Requirement(r).marker.evaluate({"extra": "tpu"})]
  assert len(here) == 1, declared
  version = libtpu.installed()
  assert version is not None, f"{here[0]} is declared for this Python but not installed: `make stack` installs it"
  assert here[0].specifier.contains(version) and libtpu.matches(version, libtpu.pinned()), (version, libtpu.pinned())


def test_training_step_matches_maxtext_train_compile(tiny_train):
  """Arguments within 2 % and peak (code + arguments + outputs - aliases + temporaries) within 10 % of MaxText's."""
  code, report, _ = tiny_train
  ours = report["xla"]["train"]
  ref = json.loads((REF / "tiny_v5p-8_b1_s256_mtp1.json").read_text())
  theirs = ref["memory_analysis"]
  assert code == 0 and report["xla"]["fits"] is True
  assert abs(ours["argument_size_in_bytes"] / theirs["argument_size_in_bytes"] - 1) < 0.02, (ours, theirs)
  assert abs(ours["peak_bytes"] / ref["peak_bytes"] - 1) < 0.10, (ours["peak_bytes"], ref["peak_bytes"])


def test_json_has_compiled_memory_stats_and_the_peak(tiny_train):
  _, report, _ = tiny_train
  ours = report["xla"]["train"]
  assert set(memory.FIELDS) <= set(ours)
  assert ours["peak_bytes"] == (ours["generated_code_size_in_bytes"] + ours["argument_size_in_bytes"]
                                + ours["output_size_in_bytes"] - ours["alias_size_in_bytes"]
                                + ours["temp_size_in_bytes"])
  assert ours["tpu_custom_calls"] > 0  # splash attention and the Megablox grouped matmul
  assert ours["alias_size_in_bytes"] > 0.99 * ours["argument_size_in_bytes"] - 2**20  # the state is donated
  assert report["xla"]["libtpu"] == libtpu.installed() and report["xla"]["devices"] == 4


def test_fp8_full_grouped_matmul_compiles_as_the_pallas_kernel():
  """With dot-product attention the only Mosaic kernels are the grouped matmul's: the export's validation forward
  (fp8_full, Qwix QT) has them; the reference kernel has none."""
  keys = [*L4, "quantization=fp8_full", "quantize_mtp=true", "attention=dot_product"]
  code, report, _ = _json("export", *keys, "--topology", "v5p-8", "--compile")
  assert code == 0 and report["xla"]["fits"] is True
  assert report["xla"]["forward"]["tpu_custom_calls"] >= 3  # wi_0, wi_1, wo
  code, reference, _ = _json("maxtext", *keys, "gmm_backend=reference", "--topology", "v5p-8", "--compile")
  assert code == 0 and reference["xla"]["forward"]["tpu_custom_calls"] == 0


def test_a_step_that_does_not_fit_is_exit_1_with_xla_figures():
  code, out, err = _cli("maxtext", *L4, "--topology", "v5p-8", "--compile", "--device-memory", "16MiB")
  assert code == 1
  assert "XLA's peak" in out and "DOES NOT FIT (short by" in out
  assert err.startswith("does not fit:") and len(err.strip().splitlines()) == 1


def test_xla_refusal_for_lack_of_hbm_is_the_verdict():
  """XLA's own compile-time out-of-memory error is "does not fit" with its figure, not a crash."""
  result = memory.XlaMemory.refused("train", "v5p-8", "RESOURCE_EXHAUSTED: Ran out of memory in memory space hbm. "
                                    "Used 120.50G of 95.74G hbm. Exceeded hbm capacity by 24.76G.", 95 * 2**30, 1.0)
  assert result.fits is False and result.peak is None
  assert result.xla_used == int(120.50 * 2**30)
  assert result.to_dict()["fits"] is False and result.to_dict()["xla_used_bytes"] == int(120.50 * 2**30)


def test_libtpu_0_0_50_refusal_names_the_temporaries_as_its_figure():
  """libtpu 0.0.50 says only that the temporaries alone exceed the HBM (its words on a v5e chip and for its AOT
  topology alike: tests/data/xla_ref/tpu_v5e_device_check.json)."""
  check = json.loads((REF / "tpu_v5e_device_check.json").read_text())
  message = next(r["aot_refusal"] for r in check["rows"] if r["aot_refusal"])
  result = memory.XlaMemory.refused("train", "v5e-1", message, int(15.75 * 2**30), 1.0)
  assert result.fits is False and result.xla_used is None
  assert result.xla_temporaries == int(18.87 * 2**30) and result.to_dict()["xla_temporaries_bytes"] == result.xla_temporaries


def test_a_batch_the_v5e_chip_refused_is_refused_here_with_the_chips_figure_and_a_way_out():
  """deepseek3-tiny at batch 96 on v5e-1: the lent chip's compiler refused it (tests/data/xla_ref/
  tpu_v5e_device_check.json); compiled here for the topology, XLA refuses it with the same temporaries, exit 1, and
  the advice plans from XLA's usable HBM. (Its first way, batch 77, compiled to XLA's peak 15.63 GiB of the 15.75 GiB
  XLA can use: docs/sharding-and-memory.md; a test would compile for minutes.)"""
  check = json.loads((REF / "tpu_v5e_device_check.json").read_text())
  chip = next(r["device_refusal"] for r in check["rows"] if r.get("device_refusal"))
  code, out, err = _cli("maxtext", "model_name=deepseek3-tiny", "mtp_num_layers=1", "per_device_batch_size=96",
                        "max_target_length=256", "--topology", "v5e-1", "--compile", "--train", "adamw", "--format",
                        "json")
  assert code == 1 and err.startswith("does not fit:") and len(err.strip().splitlines()) == 1, err[-2000:]
  doc = json.loads(out)
  xla = doc["xla"]["train"]
  chips = memory.XlaMemory.refused("train", "v5e-1", chip, xla["device_memory_bytes"], 0.0)
  assert xla["fits"] is False and xla["xla_temporaries_bytes"] == chips.xla_temporaries
  ways = doc["xla"]["advice"]["ways"]
  assert ways and all(w["command"].endswith("--topology v5e-1 --compile") for w in ways)


def test_libtpu_missing_is_one_line_exit_2(monkeypatch, capsys):
  monkeypatch.setattr(accelerator, "libtpu_installed", lambda: False)
  assert main(["maxtext", *L4, "--topology", "v5p-8", "--compile"]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "pip install -e '.[tpu]'" in err[0] and f"libtpu=={libtpu.pinned()}" in err[0]


@pytest.mark.parametrize("name, says", [("v5p-7", "unknown TPU topology 'v5p-7'"), ("h100-8", "is not a TPU slice"),
                                        ("v5p", "names a chip, not a slice")])
def test_a_topology_that_is_not_a_tpu_slice_is_one_line_naming_what_is_accepted(name, says, capsys):
  assert main(["maxtext", *L4, "--topology", name, "--compile"]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and says in err[0] and "v5p-8 to v5p-17920" in err[0]


def test_the_grouped_matmul_follows_the_compilation_target_not_the_host():
  from quant.gmm import backends  # pylint: disable=import-outside-toplevel
  from quant.gmm import pallas  # pylint: disable=import-outside-toplevel
  from quant.gmm import target  # pylint: disable=import-outside-toplevel
  assert pallas.interpret() and backends.resolve("auto") == "reference"  # this CPU host
  with target.compiling_for("tpu"):
    assert not pallas.interpret() and backends.resolve("auto") == "pallas"
  assert pallas.interpret()


def test_a_cpu_host_with_libtpu_installed_stays_on_cpu_quietly():
  """No TPU probed on this host: JAX starts on the CPU with nothing on stderr, listings print nothing there."""
  assert libtpu.installed() is not None and not accelerator.tpu_chips_present()
  probe = subprocess.run([sys.executable, "-c", "import inspect_tool, jax, os; print(jax.devices()[0].platform, "
                          "os.environ['JAX_PLATFORMS'])"], capture_output=True, text=True, cwd=REPO, check=True,
                         env={k: v for k, v in __import__("os").environ.items() if k != "JAX_PLATFORMS"})
  assert probe.stdout.split() == ["cpu", "cpu"] and probe.stderr == ""
  code, _, err = _cli("maxtext", "model_name=deepseek3-tiny")
  assert code == 0 and err == ""


def test_cpu_host_rule(tmp_path):
  """JAX_PLATFORMS=cpu only with libtpu installed, no TPU chip, no GPU plugin and nothing set by the user."""
  pci = tmp_path / "pci"
  (pci / "0000:00:04.0").mkdir(parents=True)
  (pci / "0000:00:04.0" / "vendor").write_text("0x1af4\n")
  assert not accelerator.tpu_chips_present(str(pci))
  (pci / "0000:00:05.0").mkdir()
  (pci / "0000:00:05.0" / "vendor").write_text("0x1ae0\n")
  assert accelerator.tpu_chips_present(str(pci))
  env = {"JAX_PLATFORMS": "tpu"}
  assert accelerator.keep_cpu_host_on_cpu(env) is False and env == {"JAX_PLATFORMS": "tpu"}
  env = {}
  assert accelerator.keep_cpu_host_on_cpu(env) is True and env == {"JAX_PLATFORMS": "cpu"}
