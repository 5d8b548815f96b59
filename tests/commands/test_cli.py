"""One command: `llama-scratch COMMAND` (and `python -m llama_scratch COMMAND`) runs each module's command."""

import shutil
import subprocess
import sys

import pytest

from llama_scratch import __main__ as cli
from llama_scratch import finetune_classifier


@pytest.mark.slow
def test_the_installed_command_lists_every_subcommand():
    exe = shutil.which("llama-scratch")
    assert exe, "pip install -e . installs the llama-scratch script ([project.scripts])"
    for command in ([exe, "--help"], [sys.executable, "-m", "llama_scratch", "--help"]):
        r = subprocess.run(command, capture_output=True, text=True)
        assert r.returncode == 0 and r.stderr == ""
        for name in ("finetune", "plan", "classify", "export", "generate", "download", "convert"):
            assert f"\n  {name} " in r.stdout


def test_a_wrong_or_missing_command_is_one_line_and_exit_2(capsys):
    assert cli.main(["fine-tune"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'fine-tune'" in err and "finetune" in err
    assert cli.main([]) == 2 and "commands:" in capsys.readouterr().err


@pytest.mark.slow
def test_subcommands_are_the_module_commands(capsys):
    """`plan` is `finetune --plan`, with the same output and exit status as the module's own entry point."""
    flags = ["--model", "llama3-8b", "--gpu-memory", "80"]
    assert cli.main(["plan", *flags]) == 0
    through_cli = capsys.readouterr().out
    assert finetune_classifier.main(["--plan", *flags]) == 0
    assert capsys.readouterr().out == through_cli and "GiB" in through_cli
    r = subprocess.run([sys.executable, "-m", "llama_scratch", "finetune", "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "--lora RANK" in r.stdout and "--train-last" in r.stdout
