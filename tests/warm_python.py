"""``python SCRIPT ARGS``, ``python -c CODE ARGS`` and ``python -m MODULE ARGS`` for the tests, run in a
process forked from the forkserver of tests/dist_workers.py, which imported torch and ckptstore once.

A fresh interpreter spends seconds importing torch on a loaded 2-core machine, and the crash, resume
and crash-loop tests start dozens of them. What a test checks does not depend on those imports being
fresh: each run here is still a process of its own (its own pid, killed for real by SIGKILL, its exit
status or signal reported as ``subprocess`` reports it), with the environment, working directory,
``sys.argv``, ``sys.path[0]`` and ``__main__`` a fresh interpreter would give it, its stdout and
stderr captured, and its ``atexit`` handlers run when it exits. Modules that read an environment
variable at import time see the forkserver's value: a test that sets one of those starts a real
interpreter (``subprocess``) instead (see ``IMPORT_TIME_ENV``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from typing import Any

import dist_workers

# Environment variables read when a preloaded module is imported: a forked child would not see a
# test's value, so start() and run() refuse an environment that sets one rather than ignore it.
IMPORT_TIME_ENV = ("CKPTSTORE_DIRECT_IO",)
# Their values when the test run began (test modules are imported before any test starts the forkserver).
_AT_START = {name: os.environ.get(name) for name in IMPORT_TIME_ENV}


def _child(argv: list[str], env: dict[str, str], cwd: str | None, out: str | None, err: str | None,
           new_session: bool) -> None:
    """The forked process: become ``python *argv`` and exit as that interpreter would."""
    import atexit
    import runpy
    import threading
    import types

    if new_session:
        os.setsid()
    os.environ.clear()
    os.environ.update(env)
    if cwd is not None:
        os.chdir(cwd)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    for fd, path in ((1, out), (2, err)):
        if path not in (None, "stdout"):
            f = os.open(path, os.O_WRONLY | os.O_APPEND)
            os.dup2(f, fd)
            os.close(f)
    if err == "stdout":
        os.dup2(1, 2)
    threads = env.get("OMP_NUM_THREADS", "")
    if threads.isdigit():
        import torch

        torch.set_num_threads(int(threads))
    code = 0
    try:
        if argv[0] == "-c":
            sys.argv = ["-c", *argv[2:]]
            sys.path.insert(0, "")
            main = types.ModuleType("__main__")
            main.__dict__["__builtins__"] = __builtins__
            sys.modules["__main__"] = main
            exec(compile(argv[1], "<string>", "exec"), main.__dict__)
        elif argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            sys.path.insert(0, os.getcwd())
            runpy._run_module_as_main(argv[1], alter_argv=True)  # type: ignore[attr-defined]  # what -m runs
        else:
            sys.argv = list(argv)
            sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exc:
        if exc.code is None:
            code = 0
        elif isinstance(exc.code, int):
            code = exc.code
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    # What an interpreter does on its way out: wait for non-daemon threads, run atexit, flush.
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed stream, as at interpreter exit
            pass
    os._exit(code)


class Process:
    """A started run: ``pid``, ``poll()``, ``wait(timeout)``, ``kill()`` and ``returncode`` as
    ``subprocess.Popen`` has them (negative: the signal that ended it)."""

    def __init__(self, proc: Any, new_session: bool) -> None:
        self._proc = proc
        self._new_session = new_session
        self.pid: int = proc.pid

    @property
    def returncode(self) -> int | None:
        return self._proc.exitcode

    def poll(self) -> int | None:
        return self._proc.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._proc.join(timeout)
        if self._proc.exitcode is None:
            raise subprocess.TimeoutExpired(f"python pid {self.pid}", timeout or 0)
        return self._proc.exitcode

    def kill(self) -> None:
        """SIGKILL the process (its whole session when it started one, as ``os.killpg`` of a
        ``start_new_session=True`` Popen would)."""
        if self._proc.exitcode is not None:
            return
        try:
            if self._new_session:
                try:
                    os.killpg(self.pid, signal.SIGKILL)
                    return
                except ProcessLookupError:  # killed before its setsid(): no group of its own yet
                    pass
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def start(argv: Sequence[str], *, env: Mapping[str, str] | None = None, cwd: str | os.PathLike | None = None,
          stdout: str | os.PathLike | None = None, stderr: str | os.PathLike | None = None,
          new_session: bool = False) -> Process:
    """Start ``python *argv`` (``argv`` without the interpreter: a script and its arguments, or
    ``-c CODE ...``, or ``-m MODULE ...``); ``stdout``/``stderr`` name files to append to (``stderr
    = "stdout"`` joins them), None inherits the test process's."""
    env = dict(os.environ if env is None else env)
    for name in IMPORT_TIME_ENV:
        if env.get(name) != _AT_START[name]:
            raise ValueError(f"{name} is read when ckptstore is imported, which the forkserver did before this "
                             "test set it: start this process with subprocess instead")
    ctx = dist_workers.context()
    proc = ctx.Process(target=_child, args=(list(argv), env, None if cwd is None else str(cwd),
                                            None if stdout is None else str(stdout),
                                            None if stderr is None else str(stderr), new_session))
    proc.start()
    return Process(proc, new_session)


def run(argv: Sequence[str], *, env: Mapping[str, str] | None = None, cwd: str | os.PathLike | None = None,
        timeout: float = 240, text: bool = True) -> subprocess.CompletedProcess:
    """``subprocess.run([sys.executable, *argv], capture_output=True, ...)`` from the warm forkserver;
    a run past ``timeout`` is killed and raises ``subprocess.TimeoutExpired`` as subprocess does."""
    with tempfile.TemporaryDirectory(prefix="warm-python-") as tmp:
        out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        for path in (out, err):
            open(path, "wb").close()
        proc = start(argv, env=env, cwd=cwd, stdout=out, stderr=err)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)
            raise
        with open(out, "rb") as fo, open(err, "rb") as fe:
            o, e = fo.read(), fe.read()
    args = [sys.executable, *argv]
    if text:
        return subprocess.CompletedProcess(args, proc.returncode, o.decode(errors="replace"),
                                           e.decode(errors="replace"))
    return subprocess.CompletedProcess(args, proc.returncode, o, e)

