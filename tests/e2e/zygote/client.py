"""The zygote client: `python -S client.py -m MODULE ARGS` behaves as `python -m MODULE ARGS` would (`client.py
SCRIPT.py ARGS` as `python SCRIPT.py ARGS`), with the rank forked by the zygote server (server.py) from an
interpreter that has imported torch, megatron-core and diffusers already. This process passes its stdio, working
directory and environment, forwards every signal a test or torchrun sends it (SIGTERM, SIGINT, ...) to the rank,
exits with the rank's status (a signal's death as that signal) and, killed itself (SIGKILL included), takes the rank
with it: the rank's watch thread reads this process's end of a pipe. Without a server (or one that answers "exec")
it becomes the plain interpreter (`os.execv`). Standard library only: it starts in milliseconds."""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import sys

SOCKET_VARIABLE = "MEGATRON_OMNI_TEST_ZYGOTE"
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGQUIT)


def _plain(argv: list[str]) -> None:
    os.execv(sys.executable, [sys.executable, *argv])


def main(argv: list[str]) -> None:
    path = os.environ.get(SOCKET_VARIABLE)
    if not path or not (argv[:1] == ["-m"] or argv[:1] and argv[0].endswith(".py")):
        _plain(argv)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(path)
    except OSError:
        _plain(argv)
    death_r, death_w = os.pipe()
    request = json.dumps({"argv": [sys.executable, *argv], "env": dict(os.environ), "cwd": os.getcwd()}).encode()
    socket.send_fds(conn, [struct.pack("!Q", len(request))], [0, 1, 2, death_r])
    conn.sendall(request)
    os.close(death_r)
    replies = conn.makefile("r")
    first = json.loads(replies.readline() or "{}")
    if "pid" not in first:
        conn.close()
        _plain(argv)
    child = first["pid"]
    pid_file = os.environ.get(SOCKET_VARIABLE + "_PIDS")
    if pid_file:
        with open(os.path.join(pid_file, str(os.getpid())), "w") as f:
            f.write(str(child))
    for sig in FORWARDED:
        signal.signal(sig, lambda n, _frame: os.kill(child, n))
    line = replies.readline()  # a forwarded signal interrupts the read; Python retries it (PEP 475)
    if not line:
        print(f"zygote client: the server closed before rank {child} exited", file=sys.stderr, flush=True)
        os._exit(1)
    code = json.loads(line)["exit"]
    os.close(death_w)
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code)


if __name__ == "__main__":
    main(sys.argv[1:])
