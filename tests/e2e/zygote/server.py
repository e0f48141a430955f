"""The zygote server: one interpreter per pytest worker that imports what every `python -m megatron_omni.train` rank
imports (torch, megatron-core, diffusers, transformers, matplotlib, the trainer: ~10 s of CPU, 60% of a tiny run's
rank) once, then forks a rank per request (`client.py`), the rank's stdio, working directory, environment and
arguments those of the request. It stays single-threaded (a fork from a threaded process can inherit a held
lock): one select loop over the listening socket and a SIGCHLD wake-up pipe; each child's exit status goes back
to its client. Usage: python -m tests.e2e.zygote.server SOCKET_PATH [MODULE ...] (the modules to
preload; default PRELOAD)."""

from __future__ import annotations

import importlib
import json
import os
import select
import signal
import socket
import struct
import sys
import threading

# What a tiny run of each family imports (torch, megatron-core, diffusers' models and loaders, transformers, the
# reward client, matplotlib for the reward curve), and vLLM-Omni's engine entry point, which every rank that starts an
# engine imports (vLLM configures its logging from the environment at import: a test gives one rank a logging config
# that does not exist, and STARTUP_VARIABLES sends that rank to a plain interpreter).
PRELOAD = ("torch", "numpy", "megatron.core", "diffusers", "diffusers.models", "diffusers.loaders.lora_base",
           "diffusers.models.autoencoders.autoencoder_asym_kl", "transformers", "transformers.modeling_layers",
           "matplotlib.pyplot", "megatron_omni.train", "megatron_omni.trainer.flowgrpo",
           "megatron_omni.trainer.rewards", "tests.e2e.zygote.vllm_omni_preload")
# Variables an interpreter's start or the preloaded imports read (sys.path, the hash seed, shared libraries,
# huggingface_hub's offline and cache settings, torch's logging, vLLM's logging and plugins): a request whose values
# differ from the server's (a fault-injection sitecustomize on PYTHONPATH, say) is answered "exec" and its client
# starts a plain interpreter. Variables read when a run uses them (torchrun's, inductor's cache folder, vLLM's engine
# settings, OMP_NUM_THREADS: set per rank) pass.
STARTUP_VARIABLES = ("PYTHON", "HF_", "LD_", "TRANSFORMERS_", "DIFFUSERS_", "MPL", "TORCH_LOGS", "VLLM_LOGGING",
                     "VLLM_CONFIGURE_LOGGING", "VLLM_PLUGINS")
IGNORED = ("PYTHONUNBUFFERED", "MEGATRON_OMNI_TEST_ZYGOTE")


def startup_environment(env: dict[str, str]) -> dict[str, str]:
    """The variables of `env` that an interpreter start depends on (see STARTUP_VARIABLES)."""
    return {k: v for k, v in env.items() if k.startswith(STARTUP_VARIABLES) and not k.startswith(IGNORED)}


def _reply(conn: socket.socket, message: dict) -> None:
    """One line of JSON to a client (server.py's only message format)."""
    conn.sendall((json.dumps(message) + "\n").encode())


def _recv_exactly(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise ConnectionError("the client closed its connection mid-request")
        data += chunk
    return data


def _child(request: dict, fds: list[int], default_threads: int,
           imported: dict[str, tuple[str | None, str | None]]) -> None:
    """In the forked rank: become the process `python -m MODULE ARGS` (or `python SCRIPT ARGS`) would be, then run
    the module (the script) as __main__. Never returns."""
    code = 1
    try:
        os.setsid()  # its own process group: a dying client takes the rank and its descendants with it
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGQUIT):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for target, fd in enumerate(fds[:3]):
            os.dup2(fd, target)
        death = fds[3]
        for fd in fds[:3]:
            os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        for name, (before, after) in imported.items():  # what the rank's own imports would have set
            if os.environ.get(name) == before:
                if after is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = after
        threads = os.environ.get("OMP_NUM_THREADS")
        import torch

        torch.set_num_threads(int(threads) if threads else default_threads)
        if "numpy" in sys.modules:  # a fresh interpreter seeds numpy's global generator from the OS
            sys.modules["numpy"].random.seed()

        def _die_with_the_client() -> None:
            os.read(death, 1)  # EOF: the client is gone (killed, SIGKILL included)
            os.killpg(0, signal.SIGKILL)

        threading.Thread(target=_die_with_the_client, daemon=True, name="zygote-client-watch").start()
        for stream in (sys.stdout, sys.stderr):
            stream.reconfigure(line_buffering=True)
        import runpy
        import types

        sys.modules["__main__"] = types.ModuleType("__main__")
        try:
            if request["argv"][1] == "-m":  # python -m MODULE ARGS: sys.path[0] the working directory
                sys.argv = request["argv"][2:]
                sys.path[0] = request["cwd"]
                runpy._run_module_as_main(sys.argv[0], alter_argv=True)
            else:  # python SCRIPT ARGS: sys.path[0] the script's folder
                sys.argv = request["argv"][1:]
                sys.path[0] = os.path.dirname(os.path.realpath(sys.argv[0]))
                runpy.run_path(sys.argv[0], run_name="__main__")
            code = 0
        except SystemExit as exc:
            if exc.code is None:
                code = 0
            elif isinstance(exc.code, int):
                code = exc.code
            else:
                print(exc.code, file=sys.stderr)
                code = 1
        except KeyboardInterrupt:
            import traceback

            traceback.print_exc()
            sys.stderr.flush()
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        except BaseException:  # noqa: BLE001 - what the interpreter prints for an uncaught exception
            import traceback

            traceback.print_exc()
            code = 1
        threading._shutdown()  # an interpreter's exit, in its order: the thread joins, atexit, the flushes
        import atexit

        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - a closed pipe: nothing more to say
                pass
        os._exit(code)


def serve(path: str, preload: tuple[str, ...] = PRELOAD) -> None:
    """Import `preload`, then listen on `path` until the parent (the pytest worker) is gone."""
    parent = os.getppid()
    env = dict(os.environ)
    for name in ("torch", *preload):
        importlib.import_module(name)
    import torch

    default_threads = torch.get_num_threads()
    # Variables the imports set (cv2's LD_LIBRARY_PATH, torch's inductor cache folder): (before, after) each.
    imported = {k: (env.get(k), os.environ.get(k)) for k in {*env, *os.environ} if env.get(k) != os.environ.get(k)}
    # No Python thread may run at a fork (native ones of torch's runtime are there as in any forking torch program:
    # the trainer's own forked helpers, a DataLoader's workers).
    assert threading.active_count() == 1, f"the preload started threads: {threading.enumerate()}"
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    tmp = f"{path}.{os.getpid()}"
    listener.bind(tmp)
    listener.listen(64)
    os.rename(tmp, path)  # a client that connects finds a server that is ready
    clients: dict[int, socket.socket] = {}
    expected = startup_environment(env)
    while os.getppid() == parent:
        ready, _, _ = select.select([listener, wake_r], [], [], 1.0)
        if wake_r in ready:
            os.read(wake_r, 4096)
            while True:
                try:
                    pid, status = os.waitpid(-1, os.WNOHANG)
                except ChildProcessError:
                    break
                if pid == 0:
                    break
                conn = clients.pop(pid, None)
                if conn is not None:
                    try:
                        _reply(conn, {"exit": os.waitstatus_to_exitcode(status)})
                    except OSError:
                        pass
                    conn.close()
        if listener in ready:
            conn, _ = listener.accept()
            conn.settimeout(30)
            fds: list[int] = []
            try:
                header, fds, _, _ = socket.recv_fds(conn, 8, 4)
                request = json.loads(_recv_exactly(conn, struct.unpack("!Q", header)[0]))
                asked = startup_environment(request["env"])
                # each value as the server had it before its imports, or as they left it
                accepted = {k: {expected.get(k), imported[k][1] if k in imported else expected.get(k)}
                            for k in {*asked, *expected}}
                differs = sorted(k for k, values in accepted.items() if asked.get(k) not in values)
                if differs or len(fds) != 4:
                    print(f"zygote: plain interpreter for {request['argv'][1:3]}: {differs}", file=sys.stderr,
                          flush=True)
                    _reply(conn, {"exec": f"startup environment differs: {differs[:3]}"})
                    conn.close()
                    continue
                for stream in (sys.stdout, sys.stderr):
                    stream.flush()
                pid = os.fork()
                if pid == 0:
                    listener.close()
                    conn.close()
                    os.close(wake_r)
                    os.close(wake_w)
                    for other in clients.values():
                        other.close()
                    _child(request, fds, default_threads, imported)
                clients[pid] = conn
                _reply(conn, {"pid": pid})
            except (OSError, ValueError, ConnectionError) as exc:
                print(f"zygote: a request failed: {exc!r}", file=sys.stderr, flush=True)
                conn.close()
            finally:
                for fd in fds:  # the server keeps no copy of a rank's pipes: the test's reads must see EOF
                    os.close(fd)


if __name__ == "__main__":
    serve(sys.argv[1], tuple(sys.argv[2:]) or PRELOAD)
