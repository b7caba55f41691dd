"""Which sequences each process reads, as a function of the run's data position alone.

The run reads one endless stream of sequences: serial s is block s mod N of the prepared set (in its prepared
order, e.g. the length curriculum), so the epoch is s div N. Each micro-step takes the next micro-batch × processes
serials, process r taking its contiguous slice. The data position saved in a checkpoint is then a single number,
the sequences consumed so far: resuming starts the stream there, with nothing to replay, and every optimizer step
sees the same sequences whether it ran on one process or several.
"""

from __future__ import annotations

import signal
import tempfile
from collections.abc import Iterator, Sequence

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from cram.errors import UserError


class SerialBlocks(Dataset):
    """Fixed-length token blocks addressed by serial: item s is block s mod N, returned with its serial."""

    def __init__(self, blocks, column: str = "input_ids"):
        self.blocks = blocks.with_format("torch", columns=[column])
        self.column = column

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitems__(self, serials: Sequence[int]) -> dict[str, torch.Tensor]:
        # One Arrow read for the whole micro-batch; the DataLoader passes this dict to the collator as is.
        rows = self.blocks[[serial % len(self.blocks) for serial in serials]][self.column]
        return {"input_ids": rows, "serials": torch.tensor(serials, dtype=torch.long)}

    def __getitem__(self, serial: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.blocks[serial % len(self.blocks)][self.column], "serials": torch.tensor(serial)}


class StreamSlices(Sampler[list[int]]):
    """Endless micro-batches of serials for one process, starting at global sequence `start`."""

    def __init__(self, start: int, micro_batch_size: int, process_index: int = 0, num_processes: int = 1):
        self.start = start
        self.micro_batch_size = micro_batch_size
        self.offset = process_index * micro_batch_size
        self.stride = micro_batch_size * num_processes

    def __iter__(self) -> Iterator[list[int]]:
        first = self.start + self.offset
        while True:
            yield list(range(first, first + self.micro_batch_size))
            first += self.stride


def stream_loader(
    blocks, collate_fn, *, start: int, micro_batch_size: int, process_index: int, num_processes: int,
    num_workers: int = 0, pin_memory: bool = False,
) -> DataLoader:
    """A DataLoader over the endless stream from `start`, for one process (not to be passed to `prepare`).

    `blocks` is a `datasets.Dataset` of token blocks, or a torch `Dataset` already addressed by serial like
    `SerialBlocks` (e.g. runs of a Megatron token file).
    """
    if num_workers:
        check_worker_socket_path()
    return DataLoader(
        blocks if isinstance(blocks, Dataset) else SerialBlocks(blocks),
        batch_sampler=StreamSlices(start, micro_batch_size, process_index, num_processes),
        collate_fn=collate_fn,
        num_workers=num_workers,
        pin_memory=pin_memory,
        worker_init_fn=_ignore_stop_signals if num_workers else None,
    )


# The longest path of a Unix socket (Linux's sun_path, less its final NUL), and what multiprocessing adds to the
# temporary folder for the one a loader worker hands its tensors over: pymp-XXXXXXXX/listener-XXXXXXXX.
UNIX_SOCKET_PATH_MAX = 107
WORKER_SOCKET_SUFFIX = len("/pymp-XXXXXXXX/listener-XXXXXXXX")


def check_worker_socket_path() -> None:
    """Refuse a temporary folder too deep for the Unix socket over which a loader worker passes each batch's tensors
    (torch's file-descriptor sharing): there the worker's first batch never arrives and the run waits forever."""
    folder = tempfile.gettempdir()
    if len(folder) + WORKER_SOCKET_SUFFIX > UNIX_SOCKET_PATH_MAX:
        raise UserError(f"the temporary folder {folder} is too long a path for the sockets the data loader's workers "
                        f"use (at most {UNIX_SOCKET_PATH_MAX - WORKER_SOCKET_SUFFIX} characters): set TMPDIR to a "
                        "shorter folder, e.g. /tmp, or pass --num-workers 0.")


def _ignore_stop_signals(worker_id: int) -> None:
    """Workers leave the stop signals (SIGTERM, Slurm's notice SIGUSR1, SIGINT) to the training process.

    A scheduler's signal reaches every process of the job, and Ctrl-C the whole process group; a worker that died of it
    would fail the next batch before the training process could save its state. Workers still stop when the
    loader shuts down or the training process dies.
    """
    for number in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
        signal.signal(number, signal.SIG_IGN)
