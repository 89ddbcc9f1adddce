"""MoEConfig validation and preset numbers (checked against the published model configs)."""

import dataclasses

import pytest
import torch

from megamoe import PRESETS, MoEConfig, get_preset


def test_presets_match_published_configs():
    ds = PRESETS["deepseek-v3"]
    assert (ds.hidden_size, ds.moe_intermediate_size, ds.num_experts, ds.top_k) == (7168, 2048, 256, 8)
    assert (ds.n_group, ds.topk_group, ds.routed_scaling_factor, ds.shared_intermediate_size) == (8, 4, 2.5, 2048)
    k2 = PRESETS["kimi-k2"]
    assert (k2.num_experts, k2.top_k, k2.routed_scaling_factor, k2.n_group) == (384, 8, 2.827, 1)
    q = PRESETS["qwen3-30b-a3b"]
    assert (q.hidden_size, q.moe_intermediate_size, q.num_experts, q.top_k, q.score_func) == (
        2048, 768, 128, 8, "softmax")
    assert q.shared_intermediate_size == 0
    glm = PRESETS["glm-4.5"]
    assert (glm.hidden_size, glm.moe_intermediate_size, glm.num_experts, glm.shared_intermediate_size) == (
        5120, 1536, 160, 1536)
    mok = PRESETS["mok-bench"]
    assert (mok.hidden_size, mok.moe_intermediate_size, mok.num_experts, mok.top_k, mok.shared_intermediate_size) == (
        7168, 3072, 384, 6, 3072)
    assert {"tiny", "small"} <= set(PRESETS)


def test_routed_flops():
    assert PRESETS["mok-bench"].routed_flops_fwd(2048) == 6 * 2048 * 6 * 7168 * 3072


@pytest.mark.parametrize("kwargs, match", [
    (dict(top_k=9, num_experts=8), "top_k=9 > num_experts"),
    (dict(top_k=17, num_experts=64), "top_k=17 > 16"),
    (dict(num_experts=10, n_group=4), "not divisible by n_group"),
    (dict(n_group=2, topk_group=3), "topk_group=3 > n_group"),
    (dict(num_experts=8, top_k=6, n_group=4, topk_group=1), "do not fit"),
    (dict(score_func="relu"), "score_func"),
    (dict(hidden_size=0), "hidden_size must be a positive int"),
    (dict(num_experts=1024, top_k=2), "> 512"),
    (dict(routed_scaling_factor=0.0), "routed_scaling_factor"),
    (dict(nan_policy="ignore"), "nan_policy"),
    (dict(router_dtype="bf16"), "router_dtype must be 'fp32'"),
    (dict(router_dtype=torch.bfloat16), "router_dtype"),
    (dict(dtype=torch.int8), "dtype"),
])
def test_config_rejects_bad_values(kwargs, match):
    base = dict(hidden_size=64, moe_intermediate_size=32, num_experts=8, top_k=2)
    base.update(kwargs)
    with pytest.raises(ValueError, match=match):
        MoEConfig(**base)


def test_config_frozen_and_replace():
    c = get_preset("tiny")
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.top_k = 3
    c2 = c.replace(moe_intermediate_size=48)
    assert c2.shared_intermediate_size == 48 and c.shared_intermediate_size == 32
    assert c.router_dtype == "fp32" and c.replace(router_dtype="model").router_dtype == "model"
    with pytest.raises(KeyError, match="valid presets"):
        get_preset("nope")



def test_layer_and_model_presets_are_named_apart():
    """One namespace: no name is both an MoE layer preset and a training-demo model; each lookup's error for
    the other kind's name says which kind it is and lists the valid names."""
    from megamoe.train.model import MODEL_PRESETS, get_model_preset

    assert not set(MODEL_PRESETS) & set(PRESETS)
    for name in MODEL_PRESETS:  # a training-demo model asked for as a layer preset
        with pytest.raises(KeyError, match=rf"{name}.*training demo.*valid presets: .*deepseek-v3"):
            get_preset(name)
    for name in PRESETS:  # a layer preset asked for as a training-demo model
        with pytest.raises(ValueError, match=rf"{name}.*MoE layer preset.*valid: lm-tiny, lm-mini"):
            get_model_preset(name)
    with pytest.raises(ValueError, match=r"'mini'.*did you mean 'lm-mini'"):
        get_model_preset("mini")


def test_local_experts():
    c = get_preset("deepseek-v3")
    assert c.local_experts(8) == 32
    with pytest.raises(ValueError, match="not divisible by the EP size 3"):
        c.local_experts(3)


@pytest.mark.parametrize("kwargs, match", [
    (dict(bias_update_rate=float("nan")), "bias_update_rate"),
    (dict(seq_aux_loss_coef=float("nan")), "seq_aux_loss_coef"),
    (dict(seq_aux_loss_coef=-1.0), "seq_aux_loss_coef"),
    (dict(norm_topk_prob="no"), "norm_topk_prob must be a bool"),
    (dict(routed_scaling_factor=float("inf")), "routed_scaling_factor"),
])
def test_config_rejects_nan_and_non_bool(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MoEConfig(64, 32, 8, 2, **kwargs)


def test_get_preset_names_valid_fields_for_an_unknown_override():
    with pytest.raises(TypeError, match=r"unknown MoEConfig field\(s\) \['topk'\]; valid fields: .*top_k"):
        get_preset("tiny", topk=3)
    assert get_preset("tiny", top_k=1).top_k == 1


def test_execution_options_are_frozen_defaults_and_validated():
    """EPOptions: all off by default, frozen, hashable; bad values raise naming the field and the value (a bad
    value cannot reach an exchange, where it would leave the peers waiting). KernelConfig: no overrides by
    default (tests/test_tile_config.py covers its entries). Importing them does not import triton."""
    import dataclasses
    import subprocess
    import sys

    from megamoe.config import EPOptions, KernelConfig

    assert EPOptions() == EPOptions(pull_programs=0, comm_sms=0, push_kernel=False) and hash(EPOptions()) is not None
    assert KernelConfig().tiles == () and KernelConfig().tile("down", 1, 1) is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        EPOptions().comm_sms = 16
    for kwargs, match in (({"pull_programs": 129}, "pull_programs must be an integer in \\[0, 128\\], got 129"),
                          ({"pull_programs": -1}, "pull_programs"), ({"pull_programs": True}, "pull_programs"),
                          ({"comm_sms": 65}, "comm_sms must be an integer in \\[0, 64\\], got 65"),
                          ({"comm_sms": "16"}, "comm_sms"), ({"comm_sms": 1.5}, "comm_sms")):
        with pytest.raises(ValueError, match=match):
            EPOptions(**kwargs)
    with pytest.raises(TypeError, match="push_kernel must be a bool"):
        EPOptions(push_kernel="kernel")
    code = "import sys, megamoe.config; assert 'triton' not in sys.modules"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
