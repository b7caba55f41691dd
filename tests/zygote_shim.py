"""Stands in for `python ARGUMENTS` (tests/zygote.py): asks the zygote of this environment to fork the program, then
passes signals to it and ends with its status; where no zygote serves this environment, or it refuses, runs a fresh
interpreter in its place. Standard library only: it runs as `python -S -E`, copied beside the zygotes' sockets with
the real interpreter's path on its first line."""

import hashlib
import json
import os
import signal
import socket
import sys

FOLDER = os.path.dirname(os.path.abspath(__file__))
PYTHON = "@PYTHON@"  # the real interpreter, written in when the shim is copied
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGQUIT)


def fresh(why: str) -> None:
    """Run the program in a fresh interpreter (in this process), noting why in the zygotes' folder."""
    try:
        with open(os.path.join(FOLDER, "fresh.log"), "a") as log:
            log.write(json.dumps({"why": why, "argv": sys.argv[1:4]}) + "\n")
    except OSError:
        pass
    os.execv(PYTHON, [PYTHON, *sys.argv[1:]])


def relevant_part(env: dict[str, str], known: dict) -> dict[str, str]:
    """The variables of `env` that decided what a zygote's imports did (`known`: what the first zygote read, the
    prefixes it counts whole, and those a child applies itself)."""
    read, prefixes, applied = set(known["read"]), tuple(known["prefixes"]), set(known.get("applied", ()))
    return {name: value for name, value in env.items()
            if (name in read or name.startswith(prefixes)) and name not in applied}


# What a launcher (`accelerate launch`, torchrun) does no work under: it starts the program's processes with its
# environment, so any zygote whose other variables agree serves it. The planner's candidate launches, for one, have
# no OMP_NUM_THREADS (a launcher's variable, cram/plan/launch.py), which every zygote's imports read.
THREADS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


def is_launcher(arguments: list[str]) -> bool:
    """Whether `python ARGUMENTS` runs a launcher: `accelerate launch` or torchrun, as a console script or `-m`."""
    program = os.path.basename(arguments[0]) if arguments else ""
    return (program == "torchrun" or (program == "accelerate" and arguments[1:2] == ["launch"])
            or arguments[:2] in (["-m", "torch.distributed.run"], ["-m", "accelerate.commands.launch"]))


def family(name: str) -> str:
    """The first half of a zygote's name: the variables other than THREADS, all a launcher's zygote must agree in."""
    return name.split("-")[0]


def digest(part: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(part, sort_keys=True).encode()).hexdigest()


def zygote_name(env: dict[str, str], known: dict) -> str:
    """The name of the zygote for `env`: a digest of its relevant part, the thread variables apart (a launcher
    takes any zygote of the same first half). tests/launching.py names the zygotes it starts so."""
    part = relevant_part(env, known)
    threads = {name: part.pop(name) for name in THREADS if name in part}
    return f"{digest(part)[:16]}-{digest(threads)[:4]}"


def zygote_socket() -> tuple[str | None, str]:
    """The socket of the zygote started under this environment's relevant part, if one is ready; and if none, the
    variables in which this environment differs from the first zygote's (for the log)."""
    try:
        with open(os.path.join(FOLDER, "relevant.json")) as file:
            known = json.load(file)
    except (OSError, ValueError):
        return None, "no zygote ready yet"
    name = zygote_name(dict(os.environ), known)
    if os.path.exists(os.path.join(FOLDER, f"{name}.ready")):
        return os.path.join(FOLDER, f"{name}.sock"), ""
    if is_launcher(sys.argv[1:]):
        for ready in sorted(os.listdir(FOLDER)):
            if ready.endswith(".ready") and family(ready) == family(name):
                return os.path.join(FOLDER, ready.removesuffix(".ready") + ".sock"), ""
    first, mine = known.get("first", {}), relevant_part(dict(os.environ), known)
    differing = sorted(variable for variable in mine.keys() | first.keys() if mine.get(variable) != first.get(variable))
    return None, f"no zygote for this environment (it differs from the first in {', '.join(differing[:6])})"


def main() -> None:
    path, why = zygote_socket()
    if path is None:
        fresh(why)
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        connection.connect(path)
        request = {"argv": sys.argv[1:], "env": dict(os.environ), "cwd": os.getcwd(),
                   "executable": os.path.abspath(sys.argv[0]), "cpus": sorted(os.sched_getaffinity(0))}
        socket.send_fds(connection, [json.dumps(request).encode() + b"\n"], [0, 1, 2])
        reader = connection.makefile("rb")
        answer = json.loads(reader.readline())
    except (OSError, ValueError) as error:
        fresh(f"the zygote did not answer: {error}")
    if "pid" not in answer:
        fresh(f"the zygote refused: {answer.get('fresh')}")
    child = answer["pid"]
    # The process the program runs in, for a test that looks at it rather than at this stand-in (its sockets):
    # launching.program_of reads it here while the program runs.
    program = os.path.join(FOLDER, f"{os.getpid()}.program")
    with open(program, "w") as file:
        file.write(str(child))

    def forward(number, frame):
        try:
            os.kill(child, number)
        except ProcessLookupError:
            pass

    for number in FORWARDED:
        signal.signal(number, forward)
    while True:
        try:
            line = reader.readline()
            break
        except InterruptedError:
            continue
    os.remove(program)
    if not line:  # the zygote died with its children
        sys.exit(1)
    code = os.waitstatus_to_exitcode(json.loads(line)["status"])
    if code < 0:  # ended by a signal: end so too, its handler the default one (SIGKILL's can be nothing else)
        if -code not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)


if __name__ == "__main__":  # tests/launching.py imports zygote_name
    main()
