"""megamoe inside other libraries' models.

* :mod:`megamoe.integrations.transformers`: Hugging Face transformers (>= 5): a ``"megamoe"`` experts
  implementation (``experts_implementation="megamoe"``) and a whole-block swap (:func:`swap_moe_blocks`).
  Needs ``pip install megamoe[hf]``; importing ``megamoe`` never imports transformers.
"""
