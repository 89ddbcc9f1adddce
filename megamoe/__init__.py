"""megamoe: fast, exact, reproducible mixture-of-experts layers for Hopper GPUs (PyTorch + Triton)."""

from .config import PRESETS, MoEConfig, get_preset

__all__ = ["MoEConfig", "PRESETS", "get_preset", "MoE"]
__version__ = "0.1.0"


def __getattr__(name):  # lazy: importing megamoe does not import the layer (or triton)
    if name == "MoE":
        from .layer import MoE
        return MoE
    raise AttributeError(name)
