"""The DeepSeek side of Qwix rule coverage: rules from the config, traced on the model."""
