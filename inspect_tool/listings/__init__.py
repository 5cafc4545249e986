"""The three listings, one module each, ending in the same `report.listing.ParamReport` so that every command
prints the same way: a model built abstractly from its config (`model_listing`), an Orbax checkpoint's metadata
(`orbax_listing`), Hugging Face safetensors headers (`hf_listing`). The last two never import JAX.
"""
