"""Evaluation and generation on a saved model: `megahybrid eval ppl|recall|harness` and `megahybrid generate`.

Every command loads full weights at tp = 1 in one process (megahybrid.eval.loading), so a checkpoint saved at
any TP / DP / ZeRO layout, a consolidated directory or a Hugging Face export all work, on CPU or one GPU.
Decoding goes through megahybrid.model.decode, so every mixer with a decode cache is covered by construction.
"""
