"""`hf://ORG/REPO[@REVISION][/PATH]`: a file of a Hugging Face Hub model repository as a URL to GET, through
`huggingface_hub`: its resolve URL (`hf_hub_url`, at `HF_ENDPOINT`), its headers (`build_hf_headers`: the token of
`HF_TOKEN` or of `hf auth login` as `Authorization`, a User-Agent naming this tool), and offline mode
(`HF_HUB_OFFLINE`: refused in one line, naming the cached copy when huggingface_hub's cache holds one).

A revision is a branch, a tag or a commit (default `main`); one with a slash is written percent-encoded
(`@refs%2Fpr%2F1`). The Hub's `X-Error-Code` answers become one line each: no such repository (or not readable with
the token sent), no such revision, a gated repository.
"""

from __future__ import annotations

import os
import re
import urllib.parse

from inspect_tool import __version__
from inspect_tool import errors

SCHEME = "hf://"
DEFAULT_REVISION = "main"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")
ACCEPTED = "hf://ORG/REPO[@REVISION][/PATH]"


def parse(path: str) -> tuple[str, str, str]:
  """(repo id ORG/REPO, revision, path inside the repository: '' for its top) of an hf:// path."""
  parts = path[len(SCHEME):].strip("/").split("/")
  if len(parts) < 2:
    raise errors.InputError(f"{errors.shown(path)} names no repository; accepted: {ACCEPTED}")
  org, repo = parts[0], parts[1]
  repo, _, revision = repo.partition("@")
  revision = urllib.parse.unquote(revision) if revision else DEFAULT_REVISION
  if not (_NAME.match(org) and _NAME.match(repo)) or not revision.strip() or ".." in revision:
    raise errors.InputError(f"{errors.shown(path)} is not a Hub repository path; accepted: {ACCEPTED} (names of "
                            "letters, digits, '-', '_' and '.')")
  return f"{org}/{repo}", revision, "/".join(parts[2:])


def _constants():
  # lazy: huggingface_hub, ~0.3 s to import: only hf:// paths need it
  from huggingface_hub import constants  # pylint: disable=import-outside-toplevel

  return constants


def endpoint() -> str:
  """The Hub the requests go to (`HF_ENDPOINT`, as huggingface_hub reads it)."""
  return _constants().ENDPOINT


def check_online(path: str) -> None:
  """Refuses `path` in offline mode (`HF_HUB_OFFLINE`), naming the cached snapshot when there is one."""
  constants = _constants()
  offline = constants.is_offline_mode() if hasattr(constants, "is_offline_mode") else constants.HF_HUB_OFFLINE
  if not offline:
    return
  repo_id, revision, inside = parse(path)
  cached = _cached_snapshot(repo_id, revision)
  local = f"; the cached copy is {os.path.join(cached, inside) if inside else cached}: pass that" if cached else ""
  raise errors.CheckpointError(f"{path}: HF_HUB_OFFLINE is set, so the Hub is not asked{local} (or unset "
                               "HF_HUB_OFFLINE)")


def _cached_snapshot(repo_id: str, revision: str) -> str | None:
  """The directory of `repo_id` at `revision` in huggingface_hub's cache, when its config.json is there."""
  # lazy: huggingface_hub, ~0.3 s to import: only hf:// paths need it
  import huggingface_hub  # pylint: disable=import-outside-toplevel

  try:
    found = huggingface_hub.try_to_load_from_cache(repo_id, "config.json", revision=revision)
  except Exception:  # pylint: disable=broad-except
    return None
  return os.path.dirname(found) if isinstance(found, str) else None


def request(path: str) -> tuple[str, dict]:
  """(URL, headers) to GET the file `path` (hf://ORG/REPO[@REVISION]/NAME) from the Hub."""
  # lazy: huggingface_hub, ~0.3 s to import: only hf:// paths need it
  import huggingface_hub  # pylint: disable=import-outside-toplevel
  from huggingface_hub import utils  # pylint: disable=import-outside-toplevel

  check_online(path)
  repo_id, revision, name = parse(path)
  url = huggingface_hub.hf_hub_url(repo_id, name, revision=revision)
  return url, utils.build_hf_headers(library_name="inspect_checkpoint", library_version=__version__)


def error(path: str, status: int, headers: dict, authorized: bool) -> errors.CheckpointError | None:
  """The one line for the Hub's refusal of `path` (None: a missing file, or an answer for `storage.web` to word);
  `authorized`: whether a token was sent."""
  code = headers.get("x-error-code", "")
  repo_id, revision, _ = parse(path)
  token = "with the token sent" if authorized else "without a token (HF_TOKEN is not set)"
  if code == "RepoNotFound":
    return errors.CheckpointError(f"{path}: no repository {repo_id} at {endpoint()} readable {token}: check the "
                                  "name, or set HF_TOKEN to a token that can read it")
  if code == "RevisionNotFound":
    return errors.CheckpointError(f"{path}: {repo_id} has no revision {revision!r} (a branch, tag or commit)")
  if code == "GatedRepo":
    return errors.CheckpointError(f"{path}: {repo_id} is gated: accept its conditions on the Hub and set HF_TOKEN to "
                                  "a token of that account")
  if status in (401, 403):
    return errors.CheckpointError(f"{path}: permission denied by {endpoint()} (HTTP {status}) {token}; set HF_TOKEN "
                                  "to a token that can read it")
  return None
