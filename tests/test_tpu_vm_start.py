"""A TPU VM's environment: one process on a single-host slice, JAX's runtime joined on a multi-host one.

Every TPU VM sets `TPU_WORKER_HOSTNAMES` (its own name alone, `localhost`, on a single-host slice),
`TPU_ACCELERATOR_TYPE` and often `TPU_SKIP_MDS_QUERY`. Tested without a TPU by setting those variables: on a
single-host slice nothing is joined (JAX's `distributed.initialize` is never called: it would ask the metadata
server), on several hosts it is, and a join the environment asked for that fails is one line naming the variable.
"""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import pytest

from inspect_tool import errors
from inspect_tool.distributed import runtime

from conftest import REPO
CKPT = os.path.join(REPO, "tests", "data", "ckpt_deepseek3-tiny-L4-V1024")
TINY = ["model_name=deepseek3-tiny", "mtp_num_layers=1", "override_model_config=true", "base_num_decoder_layers=4",
        "first_num_dense_layers=1", "vocab_size=1024"]
SINGLE_HOST_VM = {"TPU_WORKER_HOSTNAMES": "localhost", "TPU_ACCELERATOR_TYPE": "v5litepod-4",
                  "TPU_SKIP_MDS_QUERY": "true", "TPU_WORKER_ID": "0"}


@pytest.fixture
def joins(monkeypatch):
  """The calls made to `jax.distributed.initialize` (each then fails, as it does without a reachable job)."""
  calls = []

  def refuse(*args, **kwargs):
    calls.append(kwargs)
    raise RuntimeError("HTTPConnectionPool(host='metadata.google.internal', port=80): unreachable")

  monkeypatch.setattr(jax.distributed, "initialize", refuse)
  for name in runtime.CLUSTER_ENV + ("SLURM_NTASKS", "PMI_SIZE"):
    monkeypatch.delenv(name, raising=False)
  monkeypatch.setattr(runtime, "_started", False)
  return calls


@pytest.mark.parametrize("jax_runtime", [True, False])
def test_a_single_host_tpu_vm_runs_as_one_process(monkeypatch, joins, jax_runtime):
  for name, value in SINGLE_HOST_VM.items():
    monkeypatch.setenv(name, value)
  runtime.initialize(jax_runtime=jax_runtime)
  assert joins == []
  assert (runtime.process_index(), runtime.process_count()) == (0, 1)


@pytest.mark.parametrize("environ, variable", [
    ({"TPU_WORKER_HOSTNAMES": "t1v-n-0,t1v-n-1,t1v-n-2,t1v-n-3"}, "TPU_WORKER_HOSTNAMES"),
    ({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "16"}, "SLURM_JOB_ID"),
    ({"OMPI_COMM_WORLD_SIZE": "2"}, "OMPI_COMM_WORLD_SIZE"),
    ({"MEGASCALE_COORDINATOR_ADDRESS": "10.0.0.1:8080", "TPU_WORKER_HOSTNAMES": "localhost"},
     "MEGASCALE_COORDINATOR_ADDRESS"),
])
def test_a_job_of_several_processes_is_joined_and_a_failed_join_names_its_variable(monkeypatch, joins, environ,
                                                                                   variable):
  for name, value in environ.items():
    monkeypatch.setenv(name, value)
  assert runtime.cluster_variable() == variable
  with pytest.raises(errors.InputError) as raised:
    runtime.initialize(jax_runtime=True)
  assert len(joins) == 1
  message = str(raised.value)
  assert "\n" not in message
  assert f"{variable}=" in message and f"unset {variable} to run as one process" in message
  assert "metadata.google.internal" in message


@pytest.mark.parametrize("environ", [{"SLURM_JOB_ID": "7", "SLURM_NTASKS": "1"}, {"OMPI_COMM_WORLD_SIZE": "1"},
                                     {"TPU_WORKER_HOSTNAMES": " localhost , "}])
def test_a_job_of_one_process_is_not_joined(monkeypatch, joins, environ):
  for name, value in environ.items():
    monkeypatch.setenv(name, value)
  assert runtime.cluster_variable() is None
  runtime.initialize(jax_runtime=True)
  assert joins == []


def test_forward_and_export_run_with_a_single_host_tpu_vm_s_variables(tmp_path):
  """The commands that start processes (`forward`, `export`) run to the end with a TPU VM's variables set."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", **SINGLE_HOST_VM)
  for name in ("JAX_COORDINATOR_ADDRESS", "MEGASCALE_COORDINATOR_ADDRESS"):
    env.pop(name, None)
  commands = [["forward", *TINY, "--checkpoint", CKPT],
              ["export", *TINY, "quantization=fp8_full", "--checkpoint", CKPT, "--output", str(tmp_path / "fp8"),
               "--no-validate"]]
  for argv in commands:
    done = subprocess.run([sys.executable, "-m", "inspect_tool", *argv], capture_output=True, text=True, cwd=REPO,
                          env=env, timeout=600, check=False)
    assert done.returncode == 0, (argv[0], done.stderr[-2000:])
  assert (tmp_path / "fp8" / "export_manifest.json").is_file()
