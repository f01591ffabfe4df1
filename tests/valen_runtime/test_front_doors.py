"""valen-run, valen-serve and valen-parity take the engine options from one declaration
(cli_options.py) with the same defaults, so one command line runs one configuration from every front
door; valen-run --verbose prints what the options resolved to."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from parity.cli import main as parity_main
from parity.runtime_adapter import runtime_options
from valen_runtime.cli import main as run_main
from valen_runtime.cli_options import ENGINE_OPTION_NAMES
from valen_runtime.options import EngineOptions
from valen_runtime.serve import main as serve_main
from valen_runtime.serve import settings_from_command_line

REQUEST = {"model": "valen-preview-0923", "state": "The card was charged twice.",
           "questions": {"q": {"type": "choice", "instructions": "What next?", "criteria": {"refund": "Refund it", "wait": "Wait"}}}}
COMMANDS = {"valen-run": run_main, "valen-serve": serve_main, "valen-parity": parity_main}


def described(command, name: str):
    """Everything a user sees of one option: its flags, default, type and help."""
    param = next((p for p in command.params if p.name == name), None)
    assert param is not None, f"{command.name} has no {name}"
    return param.opts, param.secondary_opts, param.default, repr(param.type), getattr(param.type, "choices", None), param.help


@pytest.mark.parametrize("name", [*ENGINE_OPTION_NAMES, "threads"])
def test_every_front_door_declares_the_engine_options_alike(name):
    run, serve, parity = (described(command, name) for command in COMMANDS.values())
    assert run[:5] == serve[:5] == parity[:5]
    if name != "threads":  # parity's --threads help says it counts for both sides
        assert run == serve == parity


def test_engine_options_default_to_the_engine_s_choice():
    """None everywhere except dtype (the EngineOptions default): the device decides the rest."""
    for command in COMMANDS.values():
        defaults = {p.name: p.default for p in command.params if p.name in ENGINE_OPTION_NAMES}
        assert defaults == {"device": None, "dtype": EngineOptions.dtype, "mode": None, "kernels": None, "graphs": None, "compile_": None}


def engine_params(command, args: list[str]) -> dict:
    return command.make_context(command.name, args, resilient_parsing=False).params


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_same_command_line_resolves_to_the_same_options_everywhere(device, tmp_path):
    """valen-run --device cuda runs valen-serve's fast default (fast kernels, graphs, compile), and
    valen-parity's runtime side too; on the CPU all three run the reference's per-branch shape."""
    expected = EngineOptions(device=device)
    serve = settings_from_command_line(**engine_params(serve_main, ["--export", "e", "--device", device])).options
    params = engine_params(parity_main, ["--export", "e", "--checkpoint", "c", "--base", "b", "--device", device])
    parity = runtime_options(*(params[name] for name in ENGINE_OPTION_NAMES))
    request = tmp_path / "req.json"
    request.write_text(json.dumps(REQUEST))
    # A missing export fails after the options are resolved and printed, before any device is touched.
    result = CliRunner().invoke(run_main, ["--export", str(tmp_path / "missing"), "--device", device, "--verbose", str(request)])
    assert result.exit_code == 2
    printed = json.loads(result.stderr.splitlines()[0])
    assert EngineOptions(**printed["options"]) == serve == parity == expected
    if device == "cuda":
        assert (expected.mode, expected.kernels, expected.graphs, expected.compile) == ("shared-prefix", "fast", True, True)
    else:
        assert (expected.mode, expected.kernels, expected.graphs, expected.compile) == ("per-branch", "torch", False, False)


def test_valen_run_verbose_prints_the_resolved_options_as_one_json_line(tiny_export, tmp_path):
    request = tmp_path / "req.json"
    request.write_text(json.dumps(REQUEST))
    args = ["--export", str(tiny_export["separate"]), "--device", "cpu", "--mode", "shared-prefix", "--verify", "size", "--verbose", str(request)]
    result = CliRunner().invoke(run_main, args)
    assert result.exit_code == 0, result.output
    (line,) = result.stderr.splitlines()
    printed = json.loads(line)
    assert printed == {"options": EngineOptions(device="cpu", dtype="bf16", mode="shared-prefix").describe(), "verify": "size", "threads": None}
    assert {k: printed["options"][k] for k in ("kernels", "graphs", "compile", "temperature")} == {
        "kernels": "torch", "graphs": False, "compile": False, "temperature": 1.0}
    assert "answers" in json.loads(result.stdout)
    quiet = CliRunner().invoke(run_main, args[:-2] + [str(request)])
    assert quiet.exit_code == 0 and quiet.stderr == "" and json.loads(quiet.stdout) == json.loads(result.stdout)


def test_valen_run_refuses_a_temperature_its_probabilities_overflow_at_in_one_line(tiny_export, tmp_path):
    """--temperature 1e-39 passes the option's check (finite, > 0), but the logits over it overflow:
    one line and exit 2, no traceback and no JSON with NaN."""
    request = tmp_path / "req.json"
    request.write_text(json.dumps(REQUEST))
    args = ["--export", str(tiny_export["separate"]), "--device", "cpu", "--temperature", "1e-39", str(request)]
    result = CliRunner().invoke(run_main, args)
    assert result.exit_code == 2 and result.stdout == "", result.output
    (line,) = result.stderr.splitlines()
    assert line.startswith("error:") and "temperature" in line
