"""Model presets as data: `maxtext_data/models/<model_name>.yml` holds the keys MaxText 0.2.5's model file sets.

Adding a preset is adding a file there. MaxText model names outside the DeepSeek family, and DeepSeek-family names
whose architecture is not built yet (no file), are refused with one line that says so.
"""

from __future__ import annotations

import difflib
import functools
import os

import yaml

from inspect_tool import errors

DATA_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "maxtext_data")
MODELS_DIR = os.path.join(DATA_DIR, "models")
FAMILY_PREFIXES = ("deepseek", "kimi")

# DeepSeek-family names MaxText 0.2.5 accepts whose architecture this tool does not build yet (until a preset file
# for the name exists, which then takes precedence).
NOT_BUILT = {
}


def _yaml_load(text: str):
  return yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


@functools.lru_cache(maxsize=None)
def names() -> tuple[str, ...]:
  """Every preset this tool builds, sorted."""
  return tuple(sorted(f[:-4] for f in os.listdir(MODELS_DIR) if f.endswith(".yml")))


@functools.lru_cache(maxsize=None)
def maxtext_model_names() -> tuple[str, ...]:
  """Every `model_name` MaxText 0.2.5 accepts."""
  with open(os.path.join(DATA_DIR, "maxtext_models.txt"), encoding="utf-8") as f:
    return tuple(line.strip() for line in f if line.strip() and not line.startswith("#"))


def load(name: str) -> dict:
  """The keys preset `name` sets (raw YAML values), or a `KeyError` naming why it is not available."""
  if name not in names():
    raise KeyError(refusal(name))
  with open(os.path.join(MODELS_DIR, f"{name}.yml"), encoding="utf-8") as f:
    return dict(_yaml_load(f.read()) or {})


def refusal(name: str) -> str:
  """One line: why `model_name=name` is not built, and which names are."""
  known = ", ".join(names())
  if name in NOT_BUILT:
    return (f"model_name={name!r}: support for the {NOT_BUILT[name]} architecture is not built yet; "
            f"built: {known}")
  if name in maxtext_model_names() and not name.startswith(FAMILY_PREFIXES):
    return (f"model_name={name!r} is a MaxText model outside the DeepSeek family; this tool builds "
            f"DeepSeek-family models: {known} (or model_file=<your.yml> with decoder_block=deepseek)")
  close = closest(name)
  if close:
    return (f"unknown model_name {errors.shown(name)}; did you mean {close!r}? "
            "(all of them: inspect_checkpoint presets)")
  return f"unknown model_name {errors.shown(name)}; known: {known} (or pass model_file=<your.yml>)"


def closest(name: str) -> str | None:
  """The one preset `name` most likely meant (a unique name it begins, or a near spelling), else None."""
  lower = {n.lower(): n for n in names()}
  starting = [n for low, n in lower.items() if low.startswith(name.lower())]
  if len(starting) == 1:
    return starting[0]
  close = difflib.get_close_matches(name.lower(), list(lower), n=1, cutoff=0.85)
  return lower[close[0]] if close else None
