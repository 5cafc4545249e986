"""Configuration: MaxText's keys and defaults, presets, `key=value` overrides, validation."""
