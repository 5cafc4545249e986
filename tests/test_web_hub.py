"""hf://ORG/REPO[@REVISION] sources through huggingface_hub, against a local server that speaks the Hub's resolve URLs
(tests/web_server.py, named by HF_ENDPOINT): the listing equals the local directory's, reading headers alone; the
token of HF_TOKEN goes to the Hub as `Authorization` and not to where the Hub redirects; a revision reads that
revision; the Hub's refusals and offline mode (HF_HUB_OFFLINE) are one line each, exit 2. Each run is a process of its
own (huggingface_hub reads HF_ENDPOINT and HF_HUB_OFFLINE when imported), with an empty HF_HOME (no token file, no
cache of the machine's)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from web_server import Repo
from web_server import WebServer

from conftest import REPO
HF = os.path.join(REPO, "tests", "data", "import", "hf_small")
TOKEN = "hf_test_token"
SHARDS = sorted(n for n in os.listdir(HF) if n.endswith(".safetensors"))


@pytest.fixture
def hub(tmp_path):
  """The Hub: `deepseek-ai/small` (private: wants TOKEN; `main` is hf_small, `v1` a one-file directory), a gated
  repository."""
  v1 = tmp_path / "v1"
  v1.mkdir()
  shutil.copy(os.path.join(HF, SHARDS[1]), v1 / "model.safetensors")
  with WebServer() as server:
    server.hub = {"deepseek-ai/small": Repo({"main": HF, "v1": str(v1)}, token=TOKEN),
                  "deepseek-ai/gated": Repo({"main": HF}, token=TOKEN, gated=True)}
    server.home = str(tmp_path / "hf_home")
    yield server


def _run(hub, *argv, **env):
  environment = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING"))}
  environment.update(HF_ENDPOINT=hub.url, HF_HOME=hub.home, **env)
  return subprocess.run([sys.executable, "-m", "inspect_tool", *argv], capture_output=True, text=True, cwd=REPO,
                        env=environment, check=False, timeout=300)


def _local(*argv):
  return subprocess.run([sys.executable, "-m", "inspect_tool", *argv], capture_output=True, text=True, cwd=REPO,
                        check=True, timeout=300).stdout


def _ours(hub):
  """The requests of the tool (huggingface_hub also asks the Hub for its list of agent harnesses, for its User-Agent)."""
  return [r for r in hub.log if "/resolve/" in r.path or r.path.startswith("/cdn/")]


def _one_line(done, *needles) -> str:
  lines = done.stderr.strip().splitlines()
  assert done.returncode == 2 and len(lines) == 1 and done.stdout == "", done.stderr
  assert all(n in lines[0] for n in needles), lines[0]
  return lines[0]


def test_a_hub_repository_lists_as_the_local_directory_with_the_token_sent_to_the_hub_alone(hub):
  done = _run(hub, "hf", "--path", "hf://deepseek-ai/small", "--summary", HF_TOKEN=TOKEN)
  assert done.returncode == 0, done.stderr
  assert done.stdout.replace("hf://deepseek-ai/small", HF) == _local("hf", "--path", HF, "--summary")
  ours = _ours(hub)
  resolved = [r for r in ours if "/resolve/" in r.path]
  assert {r.path for r in resolved} >= {f"/deepseek-ai/small/resolve/main/{n}" for n in SHARDS + ["config.json"]}
  assert all(r.authorization == f"Bearer {TOKEN}" and r.host.startswith("127.0.0.1") for r in resolved)
  assert all("inspect_checkpoint/" in r.user_agent for r in ours)
  cdn = [r for r in ours if r.path.startswith("/cdn/")]  # where the Hub redirected the shards: no token there
  assert cdn and all(r.authorization is None and r.host.startswith("localhost") for r in cdn)
  for name in SHARDS:  # headers alone, each asked of the Hub once (then at the redirect's target)
    assert sum(r.path.endswith(f"/resolve/main/{name}") for r in resolved) == 1
    with open(os.path.join(HF, name), "rb") as f:
      assert hub.sent[f"/cdn/deepseek-ai/small/main/{name}"] == 8 + int.from_bytes(f.read(8), "little")


def test_a_revision_reads_that_revision(hub):
  done = _run(hub, "hf", "--path", "hf://deepseek-ai/small@v1", "--format", "json", HF_TOKEN=TOKEN)
  assert done.returncode == 0, done.stderr
  local = json.loads(_local("hf", "--path", os.path.join(HF, SHARDS[1]), "--format", "json"))
  assert json.loads(done.stdout)["parameters"] == local["parameters"]
  assert any(r.path == "/deepseek-ai/small/resolve/v1/model.safetensors" for r in hub.log)


def test_the_keys_of_a_hub_repository_are_the_local_ones(hub):
  done = _run(hub, "hf", "--path", "hf://deepseek-ai/small", "--keys", HF_TOKEN=TOKEN)
  assert done.returncode == 0, done.stderr
  assert done.stdout == _local("hf", "--path", HF, "--keys")


@pytest.mark.parametrize("path, env, needles", [
    ("hf://deepseek-ai/small", {}, ["no repository deepseek-ai/small at http://127.0.0.1:",
                                    "without a token (HF_TOKEN is not set)"]),
    ("hf://deepseek-ai/small", {"HF_TOKEN": "wrong"}, ["no repository deepseek-ai/small", "with the token sent"]),
    ("hf://deepseek-ai/nothing", {"HF_TOKEN": TOKEN}, ["no repository deepseek-ai/nothing"]),
    ("hf://deepseek-ai/small@v9", {"HF_TOKEN": TOKEN}, ["deepseek-ai/small has no revision 'v9'"]),
    ("hf://deepseek-ai/gated", {}, ["deepseek-ai/gated is gated", "HF_TOKEN"]),
    ("hf://deepseek-ai/small/sub", {"HF_TOKEN": TOKEN}, ["neither model.safetensors.index.json nor"]),
    ("hf://deepseek-ai", {}, ["names no repository", "accepted: hf://ORG/REPO[@REVISION][/PATH]"]),
])
def test_the_hubs_refusals_are_one_line(hub, path, env, needles):
  _one_line(_run(hub, "hf", "--path", path, "--summary", **env), *needles)


def test_offline_mode_refuses_in_one_line_without_a_request(hub):
  _one_line(_run(hub, "hf", "--path", "hf://deepseek-ai/small", HF_HUB_OFFLINE="1", HF_TOKEN=TOKEN),
            "HF_HUB_OFFLINE is set, so the Hub is not asked")
  assert not hub.log


def test_offline_mode_names_the_cached_copy(hub):
  cache = os.path.join(hub.home, "hub", "models--deepseek-ai--small")  # huggingface_hub's cache layout
  snapshot = os.path.join(cache, "snapshots", "0123abcd")
  os.makedirs(snapshot)
  os.makedirs(os.path.join(cache, "refs"))
  shutil.copy(os.path.join(HF, "config.json"), snapshot)
  with open(os.path.join(cache, "refs", "main"), "w", encoding="utf-8") as f:
    f.write("0123abcd")
  _one_line(_run(hub, "diff", "model_name=deepseek3-tiny", "--path", "hf://deepseek-ai/small", HF_HUB_OFFLINE="1"),
            f"the cached copy is {snapshot}: pass that")
