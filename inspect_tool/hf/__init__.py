"""The Hugging Face release format: config.json to MaxText keys, tensor names both ways, layouts, safetensors headers
and tensors, restore into a model, the checkpoint diff, the export layouts' rules."""
