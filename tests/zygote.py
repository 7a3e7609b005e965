"""`fedbench ARGS` as a new process that starts with fedbench already imported.

A command-line test pays Python's start and the import of torch, Hydra and fedbench (about
3 s of CPU) before the command does anything, and the suite runs a few hundred of them. A
zygote process imports them once, then forks a child per command: the child is a new
process (its own pid, working directory, environment, stdout and stderr, exit status, and
its exit handlers run), as `python -c "from fedbench.cli import main; main()" ARGS` would
be, minus the imports. The zygote itself never computes (no torch thread pool exists when
it forks: forking a process that has used OpenMP can hang the child), so the test process,
which has, never forks.

`run(args, cwd, env, timeout)` returns a `subprocess.CompletedProcess` like
`subprocess.run(..., capture_output=True, text=True)`. Tests that need a fresh interpreter
(packaging, the README's commands, signals sent to a pid) keep `subprocess`.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# the command as tests spell it: what a child runs, minus the imports
ARGV0 = "-c"


def _serve(inp, out) -> None:
    """The zygote's loop: one JSON request per line on `inp`, one JSON reply on `out`."""
    import fedbench.cli  # noqa: F401  (the imports every child inherits)
    import fedbench.runner  # noqa: F401

    for line in inp:
        req = json.loads(line)
        pid = os.fork()
        if pid == 0:
            inp.close()
            out.close()
            _child(req)  # never returns
        code = _wait(pid, req["timeout"])
        out.write(json.dumps({"code": code}) + "\n")
        out.flush()


def _child(req: dict) -> None:
    os.setpgid(0, 0)  # its own group: a timeout kills what it started too
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    for fd, path in ((1, req["stdout"]), (2, req["stderr"])):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(f, fd)
        os.close(f)
    # the inherited sys.std* are the zygote's pipes (closed above): new ones on fds 0-2
    sys.stdin = open(0, encoding="utf-8", closefd=False)  # noqa: SIM115
    sys.stdout = open(1, "w", encoding="utf-8", closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", encoding="utf-8", errors="backslashreplace", buffering=1,  # noqa: SIM115
                      closefd=False)  # fmt: skip
    sys.__stdin__, sys.__stdout__, sys.__stderr__ = sys.stdin, sys.stdout, sys.stderr
    sys.argv = [ARGV0, *req["args"]]
    from fedbench.cli import main

    # SystemExit ends the child as it ends a process: exit handlers run, then its status
    main()
    sys.exit(0)


def _wait(pid: int, timeout: float) -> int:
    end = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > end:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return -(10**6)  # the caller raises TimeoutExpired
        time.sleep(0.02)


class _Zygote:
    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        code = "import sys, zygote; zygote._serve(sys.stdin, sys.stdout)"
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**env, "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parent),
                                                                     env.get("PYTHONPATH")]))},
        )  # fmt: skip

    def run(self, args, cwd, env, timeout) -> tuple[int, str, str]:
        with tempfile.TemporaryDirectory(prefix="fedbench-zygote-") as tmp:
            o, e = Path(tmp) / "stdout", Path(tmp) / "stderr"
            req = {"args": [str(a) for a in args], "cwd": str(cwd), "env": env,
                   "stdout": str(o), "stderr": str(e), "timeout": timeout}  # fmt: skip
            self.proc.stdin.write(json.dumps(req) + "\n")
            self.proc.stdin.flush()
            reply = self.proc.stdout.readline()
            if not reply:
                raise RuntimeError("the zygote process died")
            code = json.loads(reply)["code"]
            return code, o.read_text(errors="replace"), e.read_text(errors="replace")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)


_ZYGOTES: dict[str, _Zygote] = {}


def run(
    args, cwd, env: dict[str, str] | None = None, timeout: float = 300
) -> subprocess.CompletedProcess:
    """`fedbench ARGS` in `cwd` with `env` (default: this process's), as a new process."""
    env = dict(os.environ if env is None else env)
    # one zygote per import path: its imports must be those a fresh process would make
    key = env.get("PYTHONPATH", "")
    z = _ZYGOTES.get(key)
    if z is None or z.proc.poll() is not None:
        z = _ZYGOTES[key] = _Zygote(env)
    code, out, err = z.run(args, cwd, env, timeout)
    cmd = [sys.executable, ARGV0, "from fedbench.cli import main; main()", *map(str, args)]
    if code == -(10**6):
        raise subprocess.TimeoutExpired(cmd, timeout, out, err)
    return subprocess.CompletedProcess(cmd, code, out, err)


@atexit.register
def _close_all() -> None:
    for z in _ZYGOTES.values():
        z.close()
