"""Writes inspect_tool/xla_compile/tpu_topologies.txt from MaxText 0.2.5's `utils/accelerator_to_spec_map.py`.

Usage: python scripts/make_tpu_topologies.py PATH/TO/maxtext/utils/accelerator_to_spec_map.py
(the file has no imports beyond dataclasses; it is loaded as a module and its table read).
Each line: NAME TOPOLOGY CHIP_CONFIG CHIPS_PER_HOST_BOUNDS WRAP — what `get_topology_desc` takes for that slice.
"""

import importlib.util
import os
import sys

OUT = os.path.join(os.path.dirname(__file__), "..", "inspect_tool", "xla_compile", "tpu_topologies.txt")


def main(path: str) -> None:
  spec = importlib.util.spec_from_file_location("accelerator_to_spec_map", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  lines = ["# MaxText 0.2.5 compile_topology names (utils/accelerator_to_spec_map.py) -> the arguments of",
           "# jax.experimental.topologies.get_topology_desc: topology, chip_config_name, chips_per_host_bounds, wrap.",
           "# Made by scripts/make_tpu_topologies.py; TPU slices only."]
  for name, chars in module.UserFacingNameToSystemCharacteristics.items():
    if chars.platform != "tpu":
      continue
    bounds = ",".join(str(b) for b in chars.chips_per_host_bounds)
    wrap = ",".join("1" if w else "0" for w in chars.wrap)
    lines.append(f"{name} {chars.topology_name} {chars.chip_config_name} {bounds} {wrap}")
  with open(OUT, "w", encoding="utf-8") as f:
    f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
  main(sys.argv[1])
