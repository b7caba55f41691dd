"""DeepSpeed's CPU Adam, the optimizer of every run that offloads its optimizer states: built once, before any launch
needs it, by `make setup` (`python -m cram.train.deepspeed_ops`) and by the planner before its offload candidates."""

from __future__ import annotations

import contextlib
import importlib.util
import time
from pathlib import Path

from cram.errors import UserError

# A build that changed nothing in its folder for this long while holding the lock, with no process working there,
# was interrupted.
STALE_BUILD_SECONDS = 300.0
POLL_SECONDS = 5.0  # between two looks at a locked build


def build_offload_optimizer(stale_after: float = STALE_BUILD_SECONDS) -> None:
    """Build (or load the built) DeepSpeed CPU Adam op here, once, before any offload candidate launches: a build
    killed part-way leaves a lock on which every later launch would wait for its whole --candidate-timeout. A
    build running elsewhere (its files still changing) is waited for."""
    from deepspeed.accelerator import get_accelerator
    from torch.utils.cpp_extension import _get_build_directory

    builder = get_accelerator().create_op_builder("CPUAdamBuilder")
    folder = Path(_get_build_directory(builder.name, verbose=False))
    lock = folder / "lock"
    while lock.exists():
        with contextlib.suppress(FileNotFoundError):
            last_change = max(path.stat().st_mtime for path in [folder, *folder.iterdir()])
            if time.time() - last_change > stale_after and not build_running(folder):
                raise UserError(
                    f"DeepSpeed's CPU Adam build is locked by {lock}, left by a build that was interrupted (nothing "
                    f"there changed for {stale_after / 60:g} minutes): delete that file, then plan again.")
        time.sleep(POLL_SECONDS)
    builder.load()


def build_running(folder: Path) -> bool:
    """Whether a process works in the build's folder: torch runs ninja there, and the compilers it starts inherit it.
    A build at a low priority on a busy machine (`make test` runs one beside the suite) changes no file there for
    minutes at a time."""
    import psutil

    for process in psutil.process_iter():
        with contextlib.suppress(psutil.Error, OSError):
            if Path(process.cwd()) == folder:
                return True
    return False


def main() -> None:
    """Build the op where DeepSpeed is installed; say so in one line, and nothing where it is not."""
    if importlib.util.find_spec("deepspeed") is None:
        return
    started = time.monotonic()
    build_offload_optimizer()
    print(f"DeepSpeed's CPU Adam is built ({time.monotonic() - started:.0f} s).")


if __name__ == "__main__":
    main()
