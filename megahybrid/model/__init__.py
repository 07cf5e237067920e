"""Model architecture: config and presets, layer specs per mixer, modules."""
