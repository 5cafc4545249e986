"""Reads a user's YAML file (rule files here, model files in the tool) with one-line errors."""

from __future__ import annotations

import os


def load(path, where: str, error: type[Exception]):
  """The parsed YAML document of `path`; a missing file or invalid YAML raises `error` naming `where`."""
  import yaml  # pylint: disable=import-outside-toplevel

  if not os.path.isfile(path):
    raise error(f"{where} does not exist")
  try:
    with open(path, encoding="utf-8") as f:
      return yaml.safe_load(f)
  except yaml.YAMLError as e:
    first = str(e).splitlines()[0] if str(e) else type(e).__name__
    raise error(f"{where} is not valid YAML: {first}") from None
