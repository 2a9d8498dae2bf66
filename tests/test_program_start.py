"""The batchsim program loads its modules without the collector going over what they make (it
lives to the end), and turns it back on, over none of that, for the command's own work."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

PROBE = """
import argparse, gc, json, sys
sys.argv = ["batchsim", "probe"]
collections = lambda: sum(s["collections"] for s in gc.get_stats())
before = collections()
from batchsim.scripts import cli
loading = {"collections": collections() - before, "enabled": gc.isenabled()}

def parser(only=None):
    p = argparse.ArgumentParser(prog="batchsim")
    p.add_argument("command")
    p.set_defaults(_run=lambda args: {"loading": loading, "enabled": gc.isenabled(),
                                      "frozen": gc.get_freeze_count()})
    return p

cli.build_parser = parser
sys.exit(cli.main())
"""


def test_no_collection_while_the_program_loads_and_the_collector_back_for_the_command():
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    # The few are the standard library's, before cli's first line (55-75 with numpy, rich, yaml).
    assert seen["loading"]["collections"] < 10 and seen["loading"]["enabled"] is False
    assert seen["enabled"] is True  # the command's work is collected as usual
    assert seen["frozen"] > 10_000  # what loading made is not gone over again


def test_a_module_importing_the_cli_keeps_its_collector():
    probe = "import gc; import batchsim.scripts.cli; print(gc.isenabled(), gc.get_freeze_count())"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.stdout.split() == ["True", "0"], done.stderr


def test_a_users_script_named_cli_py_importing_the_cli_keeps_its_collector(tmp_path):
    """The program was told by its file's name: a user's cli.py importing this (for GROUPS or
    build_parser) ran with the collector off for good and no Ctrl-C (review r4 item 1)."""
    script = tmp_path / "cli.py"
    script.write_text("import gc, signal\nfrom batchsim.scripts import cli\n"
                      "print(gc.isenabled(), gc.get_freeze_count(), cli._PROGRAM,\n"
                      "      signal.getsignal(signal.SIGINT) is signal.default_int_handler)\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120, check=False, cwd=tmp_path)
    assert done.stdout.split() == ["True", "0", "False", "True"], done.stderr


def test_a_console_script_copied_under_another_name_is_the_program(tmp_path):
    """The program was told by argv[0]'s name being `batchsim`: the console script under another
    name (a copy, a symlink, a second install's; a shell alias keeps argv[0] `batchsim`) loaded
    with the collector on and no Ctrl-C answer while starting; the script's own text says it is
    the program."""
    script = Path(sys.executable).parent / "batchsim"  # the console script pip installed
    if not script.is_file():
        pytest.skip("no batchsim console script beside this Python")
    renamed = tmp_path / "bsim"
    shutil.copy2(script, renamed)
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(  # reports what the program's start decided
        "import atexit, sys\n"
        "cli = lambda: sys.modules['batchsim.scripts.cli']\n"
        "atexit.register(lambda: print('program:', cli()._PROGRAM))\n")
    for program in (script, renamed):
        done = subprocess.run([str(program), "--help"], capture_output=True, text=True,
                              timeout=120, check=False, env={**os.environ, "PYTHONPATH": str(hook)})
        assert done.returncode == 0, done.stderr
        assert done.stdout.splitlines()[-1] == "program: True", program.name
    lookalike = tmp_path / "mine.py"  # a user's script that only imports main: not the program
    lookalike.write_text("import sys\nfrom batchsim.scripts.cli import main\nprint(main)\n")
    done = subprocess.run([sys.executable, str(lookalike)], capture_output=True, text=True,
                          timeout=120, check=False, env={**os.environ, "PYTHONPATH": str(hook)})
    assert done.stdout.splitlines()[-1] == "program: False", done.stderr
