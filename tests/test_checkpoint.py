"""Finding, naming and validating training-state checkpoints (the end-to-end resume lives in test_resume.py)."""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time

import pytest
from accelerate import Accelerator

from cram.errors import UserError, run_cli
from cram.train.checkpoint import (
    STATE_FILE,
    STOP_RECORD,
    Checkpointer,
    TiedCopiesNotWarned,
    check_same_run,
    complete_checkpoints,
    find_checkpoint,
)
from cram.train.layout import Layout, check_universal_supported, needs_universal, saved_layout, split_batch
from cram.train.preemption import Preemption
from cram.train.state import TrainState


def make_checkpoint(directory, name, complete=True):
    folder = directory / name
    folder.mkdir(parents=True)
    if complete:
        (folder / STATE_FILE).write_text("{}")
    return folder


def test_only_complete_step_folders_count_newest_last_by_step_number(tmp_path):
    make_checkpoint(tmp_path, "step-00000009")
    newest = make_checkpoint(tmp_path, "step-00000010")
    make_checkpoint(tmp_path, "step-00000011.tmp")  # a save cut short
    make_checkpoint(tmp_path, "step-00000012", complete=False)  # its state file is written last
    make_checkpoint(tmp_path, "final")
    assert [path.name for path in complete_checkpoints(tmp_path)] == ["step-00000009", "step-00000010"]
    assert find_checkpoint("auto", tmp_path) == newest
    assert find_checkpoint("none", tmp_path) is None
    assert find_checkpoint("auto", tmp_path / "nothing-here") is None


def test_resuming_from_a_folder_that_is_not_a_checkpoint_is_one_sentence(tmp_path):
    with pytest.raises(UserError, match="not a complete training checkpoint"):
        find_checkpoint(str(tmp_path / "step-00000004"), tmp_path)


def test_a_checkpoint_of_another_run_is_refused_with_every_difference_named(tmp_path):
    saved = {"training": {"preset": "tiny", "lr": 1e-3}, "data": {"set": "abc", "blocks": 100}}
    check_same_run(saved, {"training": {"preset": "tiny", "lr": 1e-3}, "data": {"set": "abc", "blocks": 100}}, "x")
    with pytest.raises(UserError) as refused:
        check_same_run(saved, {"training": {"preset": "tiny", "lr": 2e-3}, "data": {"set": "xyz", "blocks": 100}}, "x")
    message = str(refused.value)
    assert "training.lr: 0.001 then, 0.002 now" in message and "data.set: 'abc' then, 'xyz' now" in message
    assert "preset" not in message
    # A section added to the facts after the checkpoint was written is not compared.
    check_same_run(saved, {"training": {"preset": "tiny", "lr": 1e-3}, "batch": {"sequences_per_micro_step": 16}}, "x")


def test_checkpoints_fall_due_by_step_or_by_time_never_twice_for_one_step():
    checkpointer = Checkpointer(accelerator=None, directory="unused", run={}, every_steps=4)
    assert not checkpointer.due(TrainState(optimizer_steps=0), time_due=True)
    assert not checkpointer.due(TrainState(optimizer_steps=3), time_due=False)
    assert checkpointer.due(TrainState(optimizer_steps=4), time_due=False)
    assert checkpointer.due(TrainState(optimizer_steps=5), time_due=True)
    checkpointer.last_saved_step = 8
    assert not checkpointer.due(TrainState(optimizer_steps=8), time_due=True)
    assert not Checkpointer(accelerator=None, directory="unused", run={}).time_due()  # no interval set
    resumed = Checkpointer(accelerator=None, directory="unused", run={}, every_steps=4, resumed_at=4)
    assert not resumed.due(TrainState(optimizer_steps=4), time_due=True)  # the state it was loaded from


@pytest.fixture
def restored_signal_handlers():
    handlers = {number: signal.getsignal(number) for number in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)}
    yield
    for number, handler in handlers.items():
        signal.signal(number, handler)


def test_a_first_ctrl_c_asks_for_a_stop_and_a_second_one_interrupts_at_once(restored_signal_handlers, capsys):
    preemption = Preemption().install()
    signal.raise_signal(signal.SIGINT)
    assert preemption.requested and preemption.exit_status == 130  # the loop stops at the next step boundary
    with pytest.raises(SystemExit) as exited:
        run_cli(lambda: signal.raise_signal(signal.SIGINT))  # the second: no waiting for the step to end
    assert exited.value.code == 130 and capsys.readouterr().err == "interrupted\n"


def test_sigterm_asks_for_a_stop_however_often_it_comes(restored_signal_handlers):
    preemption = Preemption().install()
    signal.raise_signal(signal.SIGTERM)
    signal.raise_signal(signal.SIGTERM)  # a scheduler may repeat it: the state must still be saved
    assert preemption.requested and preemption.exit_status == 143


def test_slurms_notice_asks_for_a_stop_and_stays_the_reason_when_sigterm_follows(restored_signal_handlers):
    """SIGUSR1, a Slurm job's notice before its time limit (cram.slurm), stops the run as SIGTERM does; the first
    signal is the reason the run gives, though Slurm's SIGTERM may follow it (srun ending the step once a rank
    left)."""
    preemption = Preemption().install()
    signal.raise_signal(signal.SIGUSR1)
    signal.raise_signal(signal.SIGTERM)
    assert preemption.signal == signal.SIGUSR1 and preemption.exit_status == 138
    signal.raise_signal(signal.SIGINT)  # Ctrl-C after a scheduler's stop: once asks, twice interrupts
    with pytest.raises(KeyboardInterrupt):
        signal.raise_signal(signal.SIGINT)


def test_a_stopped_run_records_its_signal_step_and_time_beside_its_states(tmp_path, restored_signal_handlers):
    """What a Slurm job reads to tell a stop on its notice or a preemption (requeued) from a failure (not)."""
    accelerator = Accelerator(cpu=True)
    checkpointer = Checkpointer(accelerator, tmp_path / "checkpoints", run={}, resumed_at=3)
    preemption = Preemption().install()
    signal.raise_signal(signal.SIGUSR1)
    before = int(time.time())
    checkpointer.stop(TrainState(optimizer_steps=3), preemption)  # step 3's state is saved: only the record
    record = json.loads((tmp_path / "checkpoints" / STOP_RECORD).read_text())
    assert record["signal"] == signal.SIGUSR1 and record["step"] == 3 and before <= record["time"] <= time.time()
    assert not (tmp_path / "checkpoints" / "step-00000003").exists()


def test_after_sigterm_a_stopped_run_leaves_at_once_with_what_it_printed_flushed(restored_signal_handlers):
    # SIGTERM has SIGKILL behind it: no interpreter teardown. In a forked child, so `leave` can end a process; a
    # SystemExit (the teardown path) would reach the child's `finally` and exit 1 instead.
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:
        try:
            os.close(read_end)
            sys.stdout = os.fdopen(write_end, "w")  # block-buffered: `leave` must flush it
            preemption = Preemption().install()
            signal.raise_signal(signal.SIGTERM)
            print("state saved")
            preemption.leave()
        finally:
            os._exit(1)
    os.close(write_end)
    with os.fdopen(read_end) as pipe:
        printed = pipe.read()
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 143 and printed == "state saved\n"


def test_after_ctrl_c_a_stopped_run_exits_through_system_exit_and_gives_the_handler_back(restored_signal_handlers):
    # A notebook catches SystemExit, and its next Ctrl-C must interrupt the cell again.
    before = signal.getsignal(signal.SIGINT)
    preemption = Preemption().install()
    signal.raise_signal(signal.SIGINT)
    with pytest.raises(SystemExit) as exited:
        preemption.leave()
    assert exited.value.code == 130 and signal.getsignal(signal.SIGINT) is before


def test_a_training_state_save_of_a_tied_model_warns_of_no_shared_tensor_and_loads_back_tied(tmp_path, caplog):
    import torch
    from accelerate import Accelerator

    from cram.models.crammed_bert import CrammedBertConfig, CrammedBertForMaskedLM
    from cram.train.checkpoint import load_checkpoint

    config = CrammedBertConfig.from_preset("tiny", vocab_size=64, max_position_embeddings=8, hidden_size=16,
                                           num_hidden_layers=1, intermediate_size=32)
    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(CrammedBertForMaskedLM(config))
    with caplog.at_level(logging.WARNING):
        saved = Checkpointer(accelerator, tmp_path / "checkpoints", run={}).save(TrainState(optimizer_steps=1))
    assert "shared tensor" not in caplog.text
    assert logging.getLogger("accelerate.utils.other").filters == []  # only while saving

    with torch.no_grad():
        model.bert.embeddings.word_embeddings.weight.zero_()
    load_checkpoint(accelerator, saved)
    assert model.decoder.weight is model.bert.embeddings.word_embeddings.weight
    assert model.decoder.weight.abs().sum() > 0


def test_only_the_tied_copies_are_kept_from_the_shared_tensor_warning():
    quiet = TiedCopiesNotWarned({"decoder.weight"})

    def passes(message: str) -> bool:
        return quiet.filter(logging.LogRecord("accelerate.utils.other", logging.WARNING, "", 0, message, None, None))

    assert not passes("[RANK 0] Removed shared tensor {'decoder.weight'} while saving. This should be OK, but ...")
    assert not passes("Removed shared tensor {'_orig_mod.module.decoder.weight'} while saving.")
    assert passes("Removed shared tensor {'decoder.weight', 'head.bias'} while saving.")
    assert passes("Removed shared tensor {'encoder.weight'} while saving.")
    assert passes("some other warning")


@pytest.mark.parametrize(
    "unit, largest, processes, expected",
    [(16, 16, 2, (8, 1)),  # one process's micro-step of 16, on two: 8 each
     (16, 8, 1, (8, 2)),  # two processes' micro-step of 8 each, on one: two micro-batches of 8, not one of 16
     (4, 1, 1, (1, 4)),  # Pythia's global batch of 4 on one process at a micro-batch of at most 1
     (12, 8, 2, (6, 1)),  # the largest micro-batch up to 8 that splits each process's share of 6
     (12, 4, 2, (3, 2))],
)
def test_a_moved_run_splits_the_same_global_batch_in_the_largest_micro_batch_that_fits(
    unit, largest, processes, expected
):
    split = split_batch(unit, largest, processes)
    assert (split.micro_batch_size, split.micro_batches) == expected
    assert split.micro_batch_size * split.micro_batches * processes == unit


def test_a_global_batch_that_the_new_processes_cannot_share_is_refused_in_one_sentence():
    with pytest.raises(UserError) as refused:
        split_batch(1024, 8, 3)
    message = str(refused.value)
    assert message == ("the run's batch of 1024 sequences cannot be split evenly over 3 processes: resume on a "
                       "number of processes that divides 1024.")


@pytest.mark.parametrize(
    "saved, current, universal",
    [(Layout(2, "deepspeed", 1), Layout(2, "deepspeed", 2), True),  # DeepSpeed loads only under the saved stage
     (Layout(2, "deepspeed", 1), Layout(1, "deepspeed", 1), True),  # and only on as many ranks
     (Layout(2, "deepspeed", 2), Layout(2, "deepspeed", 3), True),
     (Layout(2, "deepspeed", 3), Layout(2, "deepspeed", 3), False),
     (Layout(2, "accelerate"), Layout(1, "accelerate"), False),  # whole model and optimizer files load anywhere
     (Layout(2, "fsdp"), Layout(4, "fsdp"), False)],  # a distributed checkpoint reshards as it loads
)
def test_a_deepspeed_state_goes_through_its_universal_form_only_where_deepspeed_cannot_load_it(
    saved, current, universal
):
    assert needs_universal(saved, current) is universal


def test_a_checkpoint_written_before_layouts_were_recorded_names_its_launch():
    record = {"state": {}, "run": {"launch": {"distributed_type": "DistributedType.DEEPSPEED", "num_processes": 2}}}
    assert saved_layout(record) == Layout(2, "deepspeed")
    record["layout"] = {"num_processes": 4, "state_format": "deepspeed", "zero_stage": 3}
    assert saved_layout(record) == Layout(4, "deepspeed", 3)


def test_a_move_through_the_universal_form_is_refused_on_a_deepspeed_older_than_it_is_tested_with():
    saved, here = Layout(2, "deepspeed", 1), Layout(1, "deepspeed", 3)
    check_universal_supported(saved, here, installed="0.19.8")
    with pytest.raises(UserError, match=r"^this state was saved on 2 process\(es\), deepspeed ZeRO-1 and DeepSpeed "
                                        r"0\.16\.0 resumes it here on 1 process\(es\), deepspeed ZeRO-3 only .*"
                                        r"pip install \"deepspeed>=0\.19\.8\", or resume on the layout that saved "
                                        r"it\.$") as refused:
        check_universal_supported(saved, here, installed="0.16.0")
    assert str(refused.value).count(". ") == 0
