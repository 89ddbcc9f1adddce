"""The README's usage snippet runs as written (GPU) and, with CPU substitutions, everywhere."""

import re
from pathlib import Path

import pytest
import torch

README = Path(__file__).resolve().parents[1] / "README.md"


def _snippet() -> str:
    return re.search(r"```python\n(.*?)```", README.read_text(), re.S).group(1)


def test_readme_snippet_on_cpu_reference_backend():
    code = (_snippet().replace('"deepseek-v3"', '"small"')
            .replace('backend="fused"', 'backend="reference"').replace('device="cuda"', 'device="cpu"'))
    ns: dict = {}
    exec(compile(code, "README.md", "exec"), ns)
    assert ns["y"].shape == ns["x"].shape and torch.isfinite(ns["y"]).all()
    assert ns["x"].grad is not None and ns["moe"].expert_bias_E.abs().sum() > 0


def test_readme_snippet_without_aux_loss_on_cpu():
    """With the balance loss off, ``loss + moe.last_stats.aux_loss`` still works as written (a zero tensor)."""
    code = (_snippet().replace('"deepseek-v3", seq_aux_loss_coef=1e-4', '"small", seq_aux_loss_coef=0.0')
            .replace('backend="fused"', 'backend="reference"').replace('device="cuda"', 'device="cpu"')
            .replace("torch.randn(2, 2048,", "torch.randn(2, 16,"))
    assert "seq_aux_loss_coef=0.0" in code and "randn(2, 16," in code
    ns: dict = {}
    exec(compile(code, "README.md", "exec"), ns)
    assert ns["moe"].last_stats.aux_loss.item() == 0.0 and ns["x"].grad is not None


@pytest.mark.gpu
def test_readme_snippet_verbatim_on_gpu():
    ns: dict = {}
    exec(compile(_snippet(), "README.md", "exec"), ns)
    assert ns["y"].shape == ns["x"].shape and torch.isfinite(ns["y"].float()).all()
    assert torch.isfinite(ns["x"].grad.float()).all()
