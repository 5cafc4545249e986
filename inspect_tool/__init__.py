"""inspect_checkpoint: see DeepSeek MoE + MTP models, their checkpoints and their quantization.

Public API, importable from here (each name is imported on first use, so `import inspect_tool` and
`inspect_checkpoint --help` do not import JAX); `docs/architecture.md` shows where each lives:
  - `resolve_config(tokens)` → `ModelConfig` (`configuration.config`)
  - `build_model(cfg, abstract=True)` → NNX `Transformer` (`model`)
  - `param_leaves(model)` → list of `paramtree.tree.Leaf` (`paramtree.params`)
  - `build_report(source, leaves, ...)` → `ParamReport`, formatted by `report.listing` (text, JSON, Markdown)
  - `export(tokens, dst, source=...)`, `export_deepseek_fp8(tokens, dst, source=...)` (`fp8_export.pipeline`)
"""

import importlib

from inspect_tool.host import accelerator as _accelerator

__version__ = "0.1.0"

_PUBLIC = {
    "resolve_config": "inspect_tool.configuration.config",
    "build_model": "inspect_tool.model",
    "param_leaves": "inspect_tool.paramtree.params",
    "build_report": "inspect_tool.report.listing",
    "export": "inspect_tool.fp8_export.pipeline",
    "export_deepseek_fp8": "inspect_tool.fp8_export.pipeline",
}
__all__ = sorted(_PUBLIC)
_accelerator.keep_cpu_host_on_cpu()  # before JAX starts: libtpu installed changes nothing on a CPU host
_accelerator.quiet_tpu_vm_advice()


def __getattr__(name: str):
  if name in _PUBLIC:
    return getattr(importlib.import_module(_PUBLIC[name]), name)
  raise AttributeError(f"module 'inspect_tool' has no attribute {name!r}")
