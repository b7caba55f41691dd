"""Stands in for the GPU image's `python3` (its stack as docs/benchmarks.md gives it), as `python image_python.py
ARGUMENTS`: this interpreter with the packages the image lacks hidden (`IMAGE_LACKS`), every program it and its forks
start and every import of pip recorded to $CRAM_TEST_STARTED, and the faults $CRAM_TEST_ROW_FAULTS names put into
the device check's recipe rows (`with_faults`), then `python -m MODULE ...`.

The device check forks its rows from this process, so the forks inherit all of it."""

import os
import resource
import runpy
import signal
import sys
import time

IMAGE_LACKS = ("datasets", "deepspeed", "omegaconf", "zstandard")
STARTING = ("subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.startfile")


def record(event: str, args: tuple) -> None:
    if event in STARTING or (event == "import" and str(args[0]).split(".")[0] == "pip"):
        with open(os.environ["CRAM_TEST_STARTED"], "a") as started:
            started.write(f"{event} {args!r}\n")


def fault(what: str) -> None:
    if what == "raise":
        raise RuntimeError("a compiler error\nat line 2")
    if what == "crash":
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # a segfault, without a core file in the repository
        os.kill(os.getpid(), signal.SIGSEGV)
    if what == "hang":
        time.sleep(3600)


def with_faults(faults: dict[str, str]) -> None:
    """Each named recipe row does its fault instead of its work: `pythia-eager`, `micro-2` (crammed BERT at twice the
    micro-batch), `norms` (the LayerNorm lever)."""
    import cram.bench.recipe_steps as recipe_steps

    real = recipe_steps.time_recipe_step

    def time_recipe_step(step, shape, setting):
        names = {"pythia-eager": step.family != recipe_steps.CRAMMED_BERT and step.compile == "false"
                 and step.logits_per_chunk is None,
                 "micro-2": step.family == recipe_steps.CRAMMED_BERT and step.micro_batch == 2 * shape.bert_batch,
                 "norms": step.bf16_norms}
        for name, what in faults.items():
            if names[name]:
                fault(what)
        return real(step, shape, setting)

    recipe_steps.time_recipe_step = time_recipe_step


for module in IMAGE_LACKS:
    sys.modules[module] = None
sys.addaudithook(record)
faults = dict(item.split(":") for item in os.environ.get("CRAM_TEST_ROW_FAULTS", "").split(",") if item)
if faults:
    with_faults(faults)
if sys.argv[1] != "-m":
    raise SystemExit("usage: image_python.py -m MODULE [ARGUMENTS]")
sys.argv = [sys.argv[2], *sys.argv[3:]]
runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
