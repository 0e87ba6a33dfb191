"""``python [options] -m mpicoll.elastic.joiner PROGRAM...``: how a process that a growth
started (:func:`mpicoll.elastic.grow.grow_world`) begins.

It merges with the running job (:func:`mpicoll.elastic.grow.join`: from then on the
world that ``comm=None`` means is the grown one), then runs ``PROGRAM`` as ``python
[options] PROGRAM...`` would have: ``script.py args...`` (``sys.path[0]`` the script's
directory), ``-m module args...`` or ``-c code args...``, as ``__main__`` with
``sys.argv`` as usual. Not meant to be run by hand.
"""
from __future__ import annotations

import os
import runpy
import sys
import traceback

from ..runtime import exit as runtime_exit
from ..runtime import failures
from .grow import join, joining, split_command_line

__all__ = ["main", "run_program"]


def run_program(program: list[str]) -> None:
    """Run ``program`` (``script args...``, ``-m module args...``, ``-c code args...``,
    also ``-mmodule``/``-ccode``) as ``__main__``, as the interpreter would.

    Raises:
        ValueError: an empty or unknown program.
    """
    if not program:
        raise ValueError("no program to run")
    first = program[0]
    if first.startswith("-m"):
        name, args = (first[2:], program[1:]) if len(first) > 2 else (program[1], program[2:])
        sys.argv = [name, *args]
        runpy.run_module(name, run_name="__main__", alter_sys=True)
    elif first.startswith("-c"):
        code, args = (first[2:], program[1:]) if len(first) > 2 else (program[1], program[2:])
        sys.argv = ["-c", *args]
        main = sys.modules["__main__"]
        namespace = {"__name__": "__main__", "__builtins__": __builtins__}
        try:
            exec(compile(code, "<string>", "exec"), namespace)  # noqa: S102  (python -c)
        finally:
            sys.modules["__main__"] = main
    elif first.startswith("-"):
        raise ValueError(f"cannot run the program {program!r}")
    else:
        sys.argv = list(program)
        if sys.path and not getattr(sys.flags, "safe_path", False):
            sys.path[0] = os.path.dirname(os.path.abspath(first))
        runpy.run_path(first, run_name="__main__")


def main() -> None:
    """Join the running job, then run the program given on the command line. Without
    ULFM, a program that raises (or exits with a status other than 0) before its elastic
    state's first sync ends the whole job (``MPI_Abort`` of the grown world): hydra does
    not end the running ranks' job when a spawned process fails, and they waited for it
    forever (under ULFM they see a process failure and go on without it). Later, the
    program ends as the running ranks' do (they share its collectives' failures and the
    stall inspector's exit notices), with its own status."""
    program = sys.argv[1:]
    options, _ = split_command_line(list(getattr(sys, "orig_argv", []))[1:])
    join(options, program)
    try:
        run_program(program)
    except BaseException as exc:
        code = exc.code if isinstance(exc, SystemExit) else 1
        if failures.ENABLED or code in (0, None) or not joining():
            raise
        traceback.print_exc()
        sys.stderr.write("mpicoll: a process that joined the job failed: the job ends\n")
        runtime_exit.abort(code if isinstance(code, int) else 1)


if __name__ == "__main__":
    main()
