"""Snakemake's command line, each call in a process forked from one that imported Snakemake once.

A call of Snakemake pays about 1.2 s of CPU importing Snakemake, its plugins and their libraries
and collecting the plugins before it reads the Snakefile, four fifths of a dry run's cost; the
suite makes some 170 calls (docs/development.md, "What the suite costs"). Each pytest worker
starts one process that imports Snakemake and then forks a child per call: the child takes the
call's working folder, environment and arguments, starts a session of its own and runs
`snakemake.cli.main`, the function the `snakemake` script runs; its output goes to files, and
its exit status and CPU time come back. Nothing of Snakemake is replaced: every call is its
command line in a process of its own, whose jobs are processes of their own as before. What a
fresh interpreter decides at its start is the forking process's: the calls of one worker share
its string-hash seed (set order while planning), and an environment variable read at start
(PYTHONPROFILEIMPORTTIME) is not read again; a test of those starts `snakemake` itself."""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

# The forking process: a request per line (argv, cwd, env, the output files), two lines back per
# request (the child's pid, at once; its exit status and CPU seconds, when it ends). It ignores
# SIGINT, as Ctrl-C reaches the worker's process group: the call's own session stops its jobs
# and ends, and the forking process reports it then.
SERVER = r"""
import atexit, json, os, signal, sys, tempfile, traceback
signal.signal(signal.SIGINT, signal.SIG_IGN)
sys.path[0] = os.path.dirname(sys.executable)  # the snakemake script's folder, not `-c`'s ''
import snakemake.api, snakemake.cli, snakemake.dag, snakemake.workflow
# What every call does or imports before it reads the Snakefile, done once here: the argument
# parser (it collects the executor, storage, report and logger plugins, each registry a
# singleton), Snakemake's storage and config libraries, and the Snakefile's schema library
snakemake.cli.get_argument_parser()
import dpath, jsonschema, requests, smart_open, snakemake.storage, yte

def child(request):
    code = 1
    try:
        os.setsid()
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        tempfile.tempdir = None  # TMPDIR as the call's environment says
        for fd, path in ((0, os.devnull), (1, request["stdout"]), (2, request["stderr"])):
            opened = os.open(path, os.O_RDONLY if fd == 0 else os.O_WRONLY | os.O_TRUNC)
            os.dup2(opened, fd)
            os.close(opened)
        sys.argv = request["argv"]
        snakemake.cli.main(request["argv"][1:])
        code = 0
    except SystemExit as end:
        code = end.code if isinstance(end.code, int) else (end.code is not None)
        if isinstance(end.code, str):
            print(end.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        # what an interpreter does as it exits, which os._exit skips: the workflow's closing
        # lines are printed from an atexit handler (imgclf.run_end)
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

for line in sys.stdin:
    request = json.loads(line)
    pid = os.fork()
    if pid == 0:
        child(request)
    print(pid, flush=True)
    _, status, usage = os.wait4(pid, 0)
    print(os.waitstatus_to_exitcode(status), usage.ru_utime + usage.ru_stime, flush=True)
"""

_server: subprocess.Popen | None = None
_lock = threading.Lock()
# CPU seconds of the calls that ended, children of the forking process, not of the caller's:
# benchmarks/suite_cost.py adds it to what the caller's own rusage counts
cpu_seconds = 0.0


@atexit.register
def _end_server():
    """The forking process ends with its input, and is waited for: its CPU time, and that of the
    calls it waited for, counts for the process that started it (benchmarks/suite_cost.py)."""
    if _server is not None:
        _server.stdin.close()
        try:
            _server.wait(timeout=10)
        except subprocess.TimeoutExpired:  # a call still running: the worker ends anyway
            _server.kill()


def _started(request: dict) -> int:
    """Hand `request` to the forking process (started if need be); the call's pid."""
    global _server
    if _server is None or _server.poll() is not None:
        _server = subprocess.Popen([sys.executable, "-c", SERVER], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, text=True)
    _server.stdin.write(json.dumps(request) + "\n")
    _server.stdin.flush()
    pid = _server.stdout.readline()
    if not pid:
        raise RuntimeError("the process that forks Snakemake's calls ended (it could not import "
                           "Snakemake?); its error is above")
    return int(pid)


class Call:
    """One call, as much of subprocess.Popen as conftest.bounded uses: pid (its session),
    communicate(timeout), wait(timeout), returncode, and stdout/stderr (None: the output is in
    files)."""

    stdout = stderr = None

    def __init__(self, argv: list[str], cwd: Path, env: dict):
        global _server
        self.args = argv
        self._files = tempfile.TemporaryDirectory(prefix="snakemake-call-")
        self._out, self._err = (Path(self._files.name) / n for n in ("stdout", "stderr"))
        self._out.touch()
        self._err.touch()
        _lock.acquire()  # released when the call has ended: one call at a time per process
        try:
            self.pid = _started({"argv": argv, "cwd": str(cwd), "env": env,
                                 "stdout": str(self._out), "stderr": str(self._err)})
        except BaseException:
            if _server is not None:
                _server.kill()
                _server = None
            _lock.release()
            raise
        self.returncode = None
        self._ended = threading.Event()
        threading.Thread(target=self._wait_for_end, args=(_server,), daemon=True).start()

    def _wait_for_end(self, server: subprocess.Popen):
        global cpu_seconds
        ended = server.stdout.readline().split()  # nothing: the forking process died
        code, cpu = ended or (-9, 0.0)
        cpu_seconds += float(cpu)
        self.returncode = int(code)
        _lock.release()
        self._ended.set()

    def wait(self, timeout: float | None = None) -> int:
        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        self.wait(timeout)
        out, err = (p.read_text(errors="replace") for p in (self._out, self._err))
        self._files.cleanup()
        return out, err
