"""A pre-imported Python that forks a process for each Python program a test starts (a zygote).

Starting Python here costs about 10 CPU-seconds before a recipe does any work (torch, transformers, Accelerate,
DeepSpeed), and the suite starts over a hundred such processes, a recipe's ranks included. A zygote imports them
once, then forks a child per program, which runs it as `python [-u] SCRIPT | -m MODULE | -c CODE ARGS...` would: a
fresh `__main__`, the program's arguments, environment, working directory, CPUs, standard streams and signals, and
its exit status passed back to the process that asked (`tests/zygote_shim.py`, which stands in for the interpreter, so
the program's pid, signals and status behave as a fresh interpreter's would for the test and for torchrun).

A child is what a fresh interpreter would be only where the environment agrees with the one the zygote imported
under: the zygote records every variable the imports read (and takes whole families that libraries read by prefix,
or read from C: `PYTHON*`, `OMP_*`, `TORCH*`...), and refuses a program whose environment differs in one of them; the
shim then runs a fresh interpreter. What a fork does not give a fresh interpreter's: the string-hash seed is the
zygote's (one per zygote, not one per process), nothing an import prints is printed again, and the process's command
line and memory high-water mark are the zygote's. Tests that read those start a fresh interpreter
(`launching.started(..., fresh=True)`).

Run by tests/launching.py as `python tests/zygote.py FOLDER NAME WATCHED_PID`; it serves `FOLDER/NAME.sock` until
WATCHED_PID (the pytest worker) is gone, then kills what it forked and exits."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import traceback
from collections.abc import Iterator

# Variables read at import where os.environ does not see them: by the interpreter and the loader at start (PYTHON*,
# LD_*, the locale), by C libraries as they load (libgomp, MKL, OpenBLAS, libtorch's logging), and whole families read
# by iterating the environment (tqdm, fsspec, networkx). The rest an import reads through os.environ, recorded below.
PREFIXES = ("PYTHON", "LD_", "LC_", "LANG", "MALLOC", "OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS", "TORCH_CPP",
            "TORCH_SHOW_CPP", "TQDM_", "FSSPEC_", "NETWORKX_")
# What the programs import before their work. `datasets` imports pyarrow, whose jemalloc starts a background thread
# as it loads (a fork would lose it): the zygote loads it with that thread off (`serve`), harmless as pyarrow's
# allocations go to mimalloc, its default pool.
PRELOAD = ("torch", "torch.distributed.run", "transformers", "transformers.modeling_utils",
           "transformers.models.bert.modeling_bert", "transformers.models.gpt_neox.modeling_gpt_neox",
           "accelerate", "accelerate.commands.accelerate_cli", "accelerate.commands.launch", "deepspeed", "peft",
           "tokenizers", "tqdm.auto", "psutil", "numpy", "yaml", "safetensors.torch", "matplotlib.pyplot", "datasets")


def torch_trace_handler() -> object | None:
    """torch's handler of TORCH_TRACE, its structured trace folder, where a child can set the folder itself: read
    once at import (torch/_logging/_internal.py `_init_logs`) into a handler that opens its file at the first
    record, and nothing recorded yet."""
    try:
        from torch._logging import _internal
    except ImportError:
        return None
    handler = getattr(_internal, "LOG_TRACE_HANDLER", None)
    return handler if hasattr(handler, "root_dir") and getattr(handler, "stream", True) is None else None


def reread_torch_trace(value: str | None) -> None:
    torch_trace_handler().root_dir = value


# Variables a child applies for itself after the fork, where the zygote can (`can`), so that they do not decide
# which zygote serves it: {name: (can, apply)}.
REREAD = {"TORCH_TRACE": (lambda: torch_trace_handler() is not None, reread_torch_trace)}
# Variables a child applies itself that the interpreter reads at start: PYTHONPATH (Accelerate's DeepSpeed launch
# adds its working folder to it for each rank). A child whose new folders hold a module of a name the zygote
# imported is refused (a fresh interpreter would have imported the other).
APPLIED = {"PYTHONPATH"}


class RecordingEnviron(os._Environ):
    """os.environ, noting each variable read."""

    read: set[str] = set()
    copying: list[str] = []  # the keys a whole copy is about to read, last first

    @staticmethod
    def note(key: object) -> None:
        # A variable's name is text: os.get_exec_path (shutil.which, subprocess of a bare name) also tries
        # env[b"PATH"], which os.environ refuses (TypeError) and which names no variable of its own.
        if isinstance(key, str):
            RecordingEnviron.read.add(key)

    def __getitem__(self, key):
        if RecordingEnviron.copying and RecordingEnviron.copying[-1] == key:
            RecordingEnviron.copying.pop()
        else:
            RecordingEnviron.copying = []
            self.note(key)
        return super().__getitem__(key)

    def keys(self):
        """A whole copy (`dict(os.environ)`, `.copy()`) reads every variable in this order, noting none: the imports
        that copy (fsspec) look for PREFIXES. Any other read ends the copy."""
        keys = dict.fromkeys(super().keys()).keys()  # a view, as os.environ's: set operations work on it
        RecordingEnviron.copying = list(keys)[::-1]
        return keys

    def __contains__(self, key):
        self.note(key)
        return super().__contains__(key)

    def items(self):
        """Every variable, none noted: the imports that iterate (tqdm, fsspec, networkx) look for PREFIXES."""
        return {self.decodekey(key): self.decodevalue(value) for key, value in self._data.items()}.items()


@contextlib.contextmanager
def recording_reads() -> Iterator[set[str]]:
    """os.environ noting the variables read, within; the set of them."""
    plain = os.environ
    # The same mapping, noting reads: not a new environment, which is why B003's warning does not apply.
    os.environ = RecordingEnviron(plain._data, plain.encodekey, plain.decodekey,  # noqa: B003
                                  plain.encodevalue, plain.decodevalue)
    try:
        yield RecordingEnviron.read
    finally:
        os.environ = plain  # noqa: B003


def preload() -> set[str]:
    """Import PRELOAD with os.environ recording; return the variables read."""
    with recording_reads() as read:
        for name in PRELOAD:
            try:
                __import__(name)
            except ImportError:
                pass  # not installed in this stack: its programs import nothing of it either
    return read


def loaded_prefixes() -> tuple[str, ...]:
    """PREFIXES, less KMP_ where no Intel OpenMP runtime is loaded (torch's wheels load GNU's): Accelerate's CPU
    launch sets KMP_AFFINITY and KMP_BLOCKTIME for its ranks, which only libiomp reads, as it loads."""
    with open("/proc/self/maps") as maps:
        intel = "libiomp" in maps.read()
    return PREFIXES if intel else tuple(prefix for prefix in PREFIXES if prefix != "KMP_")


def answer_cpu_info_once() -> None:
    """py-cpuinfo answers each call by running a Python program of its own (about a CPU-second), and DeepSpeed asks
    two to four times in each rank (its op builders, CPU Adam): the machine's answer, asked once here, is a
    child's answer too (a copy, as each call returns a new one)."""
    try:
        import cpuinfo
    except ImportError:
        return
    import copy

    answer = cpuinfo.get_cpu_info()
    cpuinfo.get_cpu_info = lambda: copy.deepcopy(answer)


def relevant(environment: dict[str, str], read: set[str], prefixes: tuple[str, ...] = PREFIXES) -> dict[str, str]:
    """The part of `environment` that decides what the preloaded imports did (not what a child applies itself)."""
    return {name: value for name, value in environment.items()
            if (name in read or name.startswith(prefixes)) and name not in APPLIED} | {
        name: "\0unset" for name in read if name not in environment and name not in APPLIED}


def path_entries(value: str | None, cwd: str) -> list[str]:
    """PYTHONPATH's folders as the interpreter puts them on sys.path, after the script's folder: absolute."""
    return [os.path.normpath(os.path.join(cwd, entry)) for entry in (value or "").split(os.pathsep) if entry]


def shadowed(entries: list[str]) -> list[str]:
    """The modules this zygote imported that `entries` hold a module of the same name of: a fresh interpreter with
    them on its path would have imported those instead (PYTHONPATH comes before site-packages)."""
    imported = {name for name in sys.modules if "." not in name}
    found = []
    for entry in entries:
        try:
            names = os.listdir(entry)
        except OSError:
            continue
        found += sorted(imported & {name.split(".")[0] for name in names if name.isidentifier()
                                    or name.endswith((".py", ".so", ".pyc"))})
    return found


def parse(arguments: list[str]) -> tuple[str, str, list[str], bool] | None:
    """`python ARGUMENTS` as (kind, target, argv, unbuffered), kind one of script/module/code; None for an option
    this zygote does not give (the shim then runs a fresh interpreter)."""
    unbuffered = False
    for index, argument in enumerate(arguments):
        if argument == "-u":
            unbuffered = True
        elif argument in ("-m", "-c"):
            if index + 1 >= len(arguments):
                return None
            target, rest = arguments[index + 1], arguments[index + 2:]
            if argument == "-m":
                return "module", target, [target, *rest], unbuffered
            return "code", target, ["-c", *rest], unbuffered
        elif argument.startswith("-"):
            return None
        else:
            return "script", argument, arguments[index:], unbuffered
    return None


def serve(folder: str, name: str, watched: int) -> dict:
    """Serve requests until the watched process is gone; in a forked child, return its request."""
    import json
    import selectors
    import socket
    import time

    import psutil
    from zygote_shim import THREADS, is_launcher

    signal.signal(signal.SIGTERM, lambda number, frame: sys.exit(0))  # tests/launching.py ends it so (a child: no)
    os.environ.setdefault("JE_ARROW_MALLOC_CONF", "background_thread:false")  # read by libarrow's jemalloc as it loads
    before, start_cwd = dict(os.environ), os.getcwd()
    read = preload()
    # What the imports themselves set in the environment (torch sets PYTORCH_NVML_BASED_CUDA_CHECK), which a child's
    # gets as well, and whose earlier value cannot have mattered: a program started by a child inherits it.
    changes = {name: value for name, value in os.environ.items() if before.get(name) != value}
    removed = [name for name in before if name not in os.environ]
    rereads = {variable: apply for variable, (can, apply) in REREAD.items() if can()}
    # JE_ARROW_MALLOC_CONF: this zygote's own, above; pyarrow reads it as well, but its allocator is loaded by then.
    read -= changes.keys() | set(removed) | set(rereads) | {"JE_ARROW_MALLOC_CONF"}
    prefixes = loaded_prefixes()
    base = relevant(before, read, prefixes)
    answer_cpu_info_once()
    # The imports' objects never change: out of the collector's sight, a child's collections do not walk them (the
    # recipes collect at their end) nor copy their pages by touching them.
    import gc
    gc.collect()
    gc.freeze()
    path = os.path.join(folder, f"{name}.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".new")
    listener.listen(64)
    os.replace(path + ".new", path)
    ready = os.path.join(folder, f"{name}.ready")
    with open(ready + ".new", "w") as file:  # whole or absent: tests/launching.py and the shim poll for it
        json.dump({"read": sorted(read), "prefixes": prefixes, "applied": sorted(APPLIED), "pid": os.getpid()}, file)
    os.replace(ready + ".new", ready)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    children: dict[int, socket.socket] = {}  # pid -> the shim's connection
    last_watch = time.monotonic()

    def answer(connection: socket.socket, message: dict) -> None:
        try:
            connection.sendall(json.dumps(message).encode() + b"\n")
        except OSError:
            pass

    def kill_tree(pid: int) -> None:
        try:
            tree = psutil.Process(pid).children(recursive=True)
        except psutil.Error:
            tree = []
        for process in [psutil.Process(pid), *tree] if psutil.pid_exists(pid) else tree:
            try:
                process.kill()
            except psutil.Error:
                pass

    while True:
        for key, _ in selector.select(timeout=0.02):
            if key.fileobj is listener:
                connection, _ = listener.accept()
                connection.setblocking(True)
                message, fds, _, _ = socket.recv_fds(connection, 1 << 20, 3)
                while not message.endswith(b"\n"):
                    more = connection.recv(1 << 20)
                    if not more:
                        break
                    message += more
                request = json.loads(message)
                parsed = parse(request["argv"])
                wanted = relevant(request["env"], read, prefixes)
                indifferent = THREADS if is_launcher(request["argv"]) else ()
                mismatch = sorted(variable for variable in wanted.keys() | base.keys()
                                  if wanted.get(variable, "\0unset") != base.get(variable, "\0unset")
                                  and variable not in indifferent)
                own_path = path_entries(before.get("PYTHONPATH"), start_cwd)
                new_path = path_entries(request["env"].get("PYTHONPATH"), request["cwd"])
                if clash := shadowed([entry for entry in new_path if entry not in own_path]):
                    mismatch.append(f"PYTHONPATH shadows {', '.join(clash[:3])}")
                if parsed is None or mismatch or len(fds) != 3:
                    for fd in fds:
                        os.close(fd)
                    answer(connection, {"fresh": "options" if parsed is None else f"environment: {mismatch[:3]}"})
                    connection.close()
                    continue
                pid = os.fork()
                if pid == 0:
                    selector.close()
                    listener.close()
                    for other in children.values():
                        other.close()
                    connection.close()
                    env = {name: value for name, value in request["env"].items() if name not in removed}
                    return {**request, "env": {**env, **changes}, "parsed": parsed, "fds": fds, "rereads": rereads,
                            "path": (own_path, new_path)}
                for fd in fds:
                    os.close(fd)
                answer(connection, {"pid": pid})
                children[pid] = connection
                selector.register(connection, selectors.EVENT_READ, pid)
            else:  # the shim closed its end: it was killed, so its program goes too
                pid = key.data
                selector.unregister(key.fileobj)
                if pid in children:
                    kill_tree(pid)
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            connection = children.pop(pid, None)
            if connection is not None:
                answer(connection, {"status": status})
                try:
                    selector.unregister(connection)
                except (KeyError, ValueError):
                    pass
                connection.close()
        if time.monotonic() - last_watch > 1:
            last_watch = time.monotonic()
            if not psutil.pid_exists(watched):
                for pid in list(children):
                    kill_tree(pid)
                for suffix in (".sock", ".ready"):
                    try:
                        os.remove(os.path.join(folder, name + suffix))
                    except OSError:
                        pass
                sys.exit(0)


def become(request: dict) -> None:
    """In the forked child: take on the program's process state, then run it as `python` would."""
    import atexit  # noqa: F401  (the program's atexit handlers run at this interpreter's exit, as in a fresh one)
    import builtins
    import io
    import random
    import runpy
    import signal
    import types
    from importlib.machinery import SourceFileLoader

    os.setsid()
    for target, fd in enumerate(request["fds"]):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    # The CPUs the stand-in may run on (a scheduler's binding), which a program it had exec'd would inherit.
    os.sched_setaffinity(0, request["cpus"])
    os.environ.clear()
    os.environ.update(request["env"])
    for variable, apply in request["rereads"].items():
        apply(os.environ.get(variable))
    own_path, new_path = request["path"]
    rest = sys.path[1:]
    for entry in own_path:
        if entry in rest:
            rest.remove(entry)
    sys.path[1:] = [*new_path, *rest]
    for number in (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGCHLD, signal.SIGQUIT,
                   signal.SIGALRM):
        signal.signal(number, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    random.seed()
    try:
        import numpy
        numpy.random.seed()
    except ImportError:
        pass
    kind, target, argv, unbuffered = request["parsed"]
    unbuffered = unbuffered or bool(os.environ.get("PYTHONUNBUFFERED"))
    encoding, errors = sys.stdout.encoding, sys.stdout.errors

    def stream(fd: int, mode: str, line_buffering: bool, errors: str) -> io.TextIOWrapper:
        raw = io.FileIO(fd, mode, closefd=False)
        if mode == "r":
            return io.TextIOWrapper(io.BufferedReader(raw), encoding=encoding, errors=errors)
        binary = raw if unbuffered else io.BufferedWriter(raw)
        return io.TextIOWrapper(binary, encoding=encoding, errors=errors, line_buffering=line_buffering,
                                write_through=unbuffered)

    sys.stdin = sys.__stdin__ = stream(0, "r", False, errors)
    sys.stdout = sys.__stdout__ = stream(1, "w", os.isatty(1), errors)
    sys.stderr = sys.__stderr__ = stream(2, "w", True, "backslashreplace")
    sys.executable = request["executable"]  # a program's own Python programs start through the shim too
    sys.argv = list(argv)
    main = types.ModuleType("__main__")
    main.__dict__.update(__builtins__=builtins, __spec__=None, __package__=None, __cached__=None)
    sys.modules["__main__"] = main
    if kind == "script":
        sys.path[0] = os.path.dirname(os.path.realpath(target))
        main.__file__ = os.path.abspath(target)  # absolute, as since Python 3.9; sys.argv[0] stays as given
        main.__loader__ = SourceFileLoader("__main__", target)
        with open(target, "rb") as file:
            code = compile(file.read(), target, "exec")
        exec(code, main.__dict__)
    elif kind == "module":
        sys.path[0] = os.getcwd()
        runpy._run_module_as_main(target, alter_argv=True)
    else:
        sys.path[0] = ""
        exec(compile(target, "<string>", "exec"), main.__dict__)


def end(status: int, ended_by: int | None) -> None:
    """End the child as the interpreter ends: wait for its non-daemon threads, run its atexit handlers, flush its
    streams. Not the teardown of every module after that (3 s of torch's and transformers', which a program cannot
    tell from outside but by its wall time)."""
    import atexit
    import threading

    try:
        threading._shutdown()
    except BaseException:
        sys.excepthook(*sys.exc_info())
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    if ended_by is not None:
        signal.signal(ended_by, signal.SIG_DFL)
        os.kill(os.getpid(), ended_by)
    os._exit(status & 0xFF)


if __name__ == "__main__":
    sys.stdin.close()
    request = serve(sys.argv[1], sys.argv[2], int(sys.argv[3]))
    ended_by = None
    try:
        become(request)
        status = 0
    except SystemExit as stop:  # as the interpreter reads sys.exit's argument
        if stop.code is None or isinstance(stop.code, int):
            status = stop.code or 0
        else:
            print(stop.code, file=sys.stderr)
            status = 1
    except KeyboardInterrupt:
        traceback.print_exc()
        status, ended_by = 130, signal.SIGINT  # a fresh interpreter ends itself by SIGINT
    except BaseException:
        sys.excepthook(*sys.exc_info())
        status = 1
    end(status, ended_by)
