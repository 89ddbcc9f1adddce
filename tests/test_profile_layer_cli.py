"""scripts/profile_layer.py's command line (the profile itself needs a CUDA GPU): options become its frozen
Options, bad input stops before any run with a message naming it."""

import importlib.util
import pathlib
import sys

import pytest


@pytest.fixture
def script(monkeypatch):
    path = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "profile_layer.py"
    spec = importlib.util.spec_from_file_location("profile_layer", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclass looks its module up
    spec.loader.exec_module(module)
    return module


def test_options_from_the_command_line(script):
    out, cases, opts = script.parse_args(["out", "qwen3-30b-a3b:16384", "--fp8", "--uncached", "--steps-only", "3"])
    assert (out, cases) == ("out", [("qwen3-30b-a3b", 16384)])
    assert opts == script.Options(fp8=True, uncached=True, ep1=False, host=False, steps_only=3)
    _, cases, opts = script.parse_args(["out", "--ep1", "--host"])
    assert cases == [("qwen3-30b-a3b", 16384), ("deepseek-v3", 4096)] and opts.ep1 and opts.host and not opts.fp8
    # flags before, between and after the cases (scripts/gpu.sh appends its case strings' flags)
    _, cases, opts = script.parse_args(["out", "--steps-only", "3", "qwen3-30b-a3b:64", "--fp8", "deepseek-v3:32"])
    assert cases == [("qwen3-30b-a3b", 64), ("deepseek-v3", 32)] and opts.fp8 and opts.steps_only == 3


@pytest.mark.parametrize("argv, match", [
    (["out", "--uncached"], "give --fp8 with it"),
    (["out", "qwen3-30b-a3b:x"], "expected PRESET:TOKENS"),
    (["out", "qwen3-30b-a3b:0"], "tokens per rank must be > 0, got 0"),
    (["out", "nosuch:64"], "unknown MoE layer preset 'nosuch'"),
    (["out", "--fp8", "--steps-only", "-1"], "--steps-only must be >= 0"),
    (["out", "--host", "--steps-only", "2"], "not with --steps-only"),
])
def test_bad_command_lines_stop_with_a_message(script, argv, match, capsys):
    with pytest.raises(SystemExit):
        script.parse_args(argv)
    assert match in capsys.readouterr().err
