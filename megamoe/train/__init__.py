"""``megamoe.train``: train a small MoE language model end to end (``python -m megamoe.train``).

Modules: ``data`` (byte tokens from text every machine has), ``model`` (decoder with megamoe.MoE FFNs,
size presets), ``loop`` (training loop, checkpoints, metrics), ``timing`` (MoE share of step time),
``plots`` (loss curves, expert-load heatmap), ``report`` (progress bar, summary), ``check``
(``--check``: backends and EP sizes compared), ``__main__`` (the command line). See docs/train.md.
"""
