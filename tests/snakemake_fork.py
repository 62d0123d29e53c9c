"""Snakemake's command line, each call in a process forked from one that imported Snakemake once.

A call of Snakemake pays about 1 s of CPU importing Snakemake, its plugins and their libraries
before it reads the Snakefile, two thirds of a dry run's cost; the suite makes some 170 calls
(docs/development.md, "What the suite costs"). Each pytest worker starts one process that
imports Snakemake and then forks a child per call: the child takes the call's working folder,
environment and arguments, starts a session of its own and runs `snakemake.cli.main`, the
function the `snakemake` script runs; its output goes to files, and its exit status and CPU
time come back. Nothing of Snakemake is replaced: every call is its command line in a process of
its own, whose jobs are processes of their own as before."""

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
# request (the child's pid, at once; its exit status and CPU seconds, when it ends).
SERVER = r"""
import json, os, signal, sys, tempfile, traceback
import snakemake.api, snakemake.cli, snakemake.dag, snakemake.workflow

def child(request):
    os.setsid()
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even where a shell ignored it
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    tempfile.tempdir = None  # TMPDIR as the call's environment says
    for fd, path in ((0, os.devnull), (1, request["stdout"]), (2, request["stderr"])):
        opened = os.open(path, os.O_RDONLY if fd == 0 else os.O_WRONLY | os.O_TRUNC)
        os.dup2(opened, fd)
        os.close(opened)
    sys.argv = request["argv"]
    try:
        snakemake.cli.main(request["argv"][1:])
        code = 0
    except SystemExit as end:
        code = end.code if isinstance(end.code, int) else (end.code is not None)
        if isinstance(end.code, str):
            print(end.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        code = 1
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
        _server.wait()


class Call:
    """One call, as much of subprocess.Popen as conftest.run_bounded uses: pid (its session),
    communicate(timeout), wait(), returncode, and stdout/stderr (None: the output is in files)."""

    stdout = stderr = None

    def __init__(self, argv: list[str], cwd: Path, env: dict):
        global _server
        self._files = tempfile.TemporaryDirectory(prefix="snakemake-call-")
        self._out, self._err = (Path(self._files.name) / n for n in ("stdout", "stderr"))
        self._out.touch()
        self._err.touch()
        _lock.acquire()  # released when the call has ended: one call at a time per process
        if _server is None or _server.poll() is not None:
            _server = subprocess.Popen([sys.executable, "-c", SERVER], stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, text=True)
        request = {"argv": argv, "cwd": str(cwd), "env": env, "stdout": str(self._out),
                   "stderr": str(self._err)}
        _server.stdin.write(json.dumps(request) + "\n")
        _server.stdin.flush()
        self.pid = int(_server.stdout.readline())
        self.returncode = None
        self._ended = threading.Event()
        threading.Thread(target=self._wait_for_end, daemon=True).start()

    def _wait_for_end(self):
        global cpu_seconds
        ended = _server.stdout.readline().split()  # nothing: the forking process died
        code, cpu = ended or (-9, 0.0)
        cpu_seconds += float(cpu)
        self.returncode = int(code)
        _lock.release()
        self._ended.set()

    def wait(self, timeout: float | None = None) -> int:
        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired(sys.argv, timeout)
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        self.wait(timeout)
        out, err = (p.read_text(errors="replace") for p in (self._out, self._err))
        self._files.cleanup()
        return out, err
