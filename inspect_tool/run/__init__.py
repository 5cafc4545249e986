"""Running the model: token batches, the forward pass, metrics, and what fits in memory."""
