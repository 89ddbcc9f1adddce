"""The README's usage snippet runs as written (GPU) and, with CPU substitutions, everywhere."""

import re
from pathlib import Path

import pytest
import torch

from megamoe import reference as ref

README = Path(__file__).resolve().parents[1] / "README.md"


def _snippet() -> str:
    return re.search(r"```python\n(.*?)```", README.read_text(), re.S).group(1)


def test_readme_snippet_on_cpu_reference_backend():
    code = (_snippet().replace('"deepseek-v3"', '"small"')
            .replace('backend="fused"', 'backend="reference"').replace('device="cuda"', 'device="cpu"')
            .replace("moe.update_expert_bias()", "bias_before = moe.expert_bias_E.clone(); moe.update_expert_bias()"))
    assert "bias_before" in code
    ns: dict = {}
    exec(compile(code, "README.md", "exec"), ns)
    moe, x, cfg = ns["moe"], ns["x"], ns["cfg"]
    # what the snippet computed is the reference layer's output, input gradient and bias update
    xr = x.detach().clone().requires_grad_()
    x_TD = xr.reshape(-1, cfg.hidden_size)
    out, r = ref.moe_layer(x_TD, moe.router_w_ED, ns["bias_before"], moe.w13_LGD, moe.w2_LDF, moe.shared_w13_HD,
                           moe.shared_w2_DS, cfg)
    assert torch.equal(ns["y"], out.view_as(x))
    aux = ref.seq_balance_loss(r.scores_TE, r.topk_ids_TK, x.shape[-2], cfg.top_k, cfg.seq_aux_loss_coef)
    (out.view_as(x).float().square().mean() + aux).backward()
    assert torch.equal(x.grad, xr.grad)
    counts = ref.tokens_per_expert(r.topk_ids_TK, cfg.num_experts)
    want = ref.update_expert_bias_(ns["bias_before"].clone(), counts, cfg.bias_update_rate)
    assert torch.equal(moe.expert_bias_E, want) and not torch.equal(want, ns["bias_before"])


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
