"""Training: run configs, the DeepSpeed engine, the loop, checkpoints, monitoring. Entry: `megahybrid train`."""
