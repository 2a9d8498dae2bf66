"""A Python child process that runs one of batchsim's modules as __main__ (the drawing child, the
records' writer), as `python -c START_CODE ARGS...`."""

from __future__ import annotations


def start_code(module: str) -> str:
    """The -c code that runs `module` as __main__. `-m` would put the working directory first on
    the child's path, where a numpy.py or matplotlib/ of the user's would run in it (the console
    script's parent never imports from there); -c puts '' there, taken out (PYTHONSAFEPATH would
    do it from 3.11 only). The working directory stays: run directories may be relative paths."""
    return ("import sys; sys.path[:1] = [p for p in sys.path[:1] if p]; import runpy; "
            f"runpy.run_module({module!r}, run_name='__main__')")
