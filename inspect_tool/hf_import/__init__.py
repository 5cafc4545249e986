"""`inspect_checkpoint import`: a Hugging Face DeepSeek release (FP8 or float) into a MaxText Orbax checkpoint."""
