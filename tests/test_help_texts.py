"""`batchsim COMMAND --help` says each flag's default, also where it is "none" (the README's
promise: what it does, its unit, its default)."""

from __future__ import annotations

import argparse

import pytest
from batchsim.scripts import cli

from tests.cli_calls import flag_helps


@pytest.mark.parametrize("command", ["run", "compare", "sweep", "serve"])
def test_flags_left_unset_say_what_unset_means(command):
    helps = flag_helps(command)
    for flag in ("--quantize", "--kv-bits", "--max-concurrency", "--max-input-len",
                 "--max-output-len"):
        if flag in helps:
            assert "default" in helps[flag], (command, flag, helps[flag])



def test_quantize_says_its_default_plainly():
    """It read 'default: as the model is: --dtype's for a zoo model' (two colons, unclear)."""
    assert "default: unquantized, in --dtype" in flag_helps("run")["--quantize"]


def test_validate_help_says_how_long_and_what_is_short():
    """`validate --help` did not say its default takes about an hour on a 2-core CPU."""
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    text = " ".join(sub.choices["validate"].format_help().split())
    assert "about an hour" in text and "matrix.yaml" in text
    assert "--cases NAME,... --repeats 1" in text and "--measured-from" in text


@pytest.mark.parametrize("command, flag", [
    ("size", "--quantize"), ("size", "--kv-bits"), ("size", "--context-dist"),
    ("size", "--memory-gb"), ("size", "--spec-tokens"), ("models", "--quantize"),
    ("run", "--concurrency"), ("run", "--ramp-end-rate"), ("run", "--shared-prefix-tokens"),
    ("run", "--turns"), ("run", "--sessions"), ("sweep", "--workload"),
    ("bench-decode", "--continuous"),
])
def test_optional_flags_say_what_unset_means(command, flag):
    """A new user's pass found these saying what they do but not what leaving them out does."""
    assert "default" in flag_helps(command)[flag], (command, flag)


def test_quantize_help_is_one_text():
    """bench-decode said 'default: as the model is' where run says what that is."""
    assert flag_helps("bench-decode")["--quantize"] == flag_helps("run")["--quantize"]


@pytest.mark.parametrize("command, flag, unit", [
    ("run", "--prefill-step-size", "tokens"), ("run", "--max-num-batched-tokens", "tokens"),
    ("roofline", "--max-seconds-per-point", "seconds"),
])
def test_numeric_flags_name_their_unit(command, flag, unit):
    assert unit in flag_helps(command)[flag], (command, flag)
