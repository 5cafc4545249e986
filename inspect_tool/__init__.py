"""inspect_checkpoint: see DeepSeek MoE + MTP models, their checkpoints and their quantization.

Public API (imported lazily so that `inspect_checkpoint --help` does not import JAX):
  - `config.resolve_config(tokens)` → `ModelConfig`
  - `model.build_model(cfg, abstract=True)` → NNX `Transformer`
  - `params.param_leaves(model)` → list of `tree.Leaf`
  - `report.listing.build_report(...)` and its formatters
"""

__version__ = "0.1.0"
