"""Run recipes/cram.py (with the arguments given) with every data preparation slowed by
$CRAM_TEST_PREPARATION_SECONDS, standing in for a corpus that takes hours to prepare; each rank writes the timeout
of the process group it trained in to $CRAM_TEST_GROUP_TIMEOUT_DIR/rank-N.json."""

import importlib
import json
import os
import runpy
import sys
import time
from pathlib import Path

import torch
import torch.distributed

prepare_module = importlib.import_module("cram.data.prepare")  # `cram.data.prepare` is also the function's name

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "cram.py"
build = prepare_module._build
init_process_group = torch.distributed.init_process_group


def slow_build(*args, **kwargs):
    time.sleep(float(os.environ["CRAM_TEST_PREPARATION_SECONDS"]))
    return build(*args, **kwargs)


def recording_init_process_group(*args, **kwargs):
    """Create the group, then record the timeout its backend enforces (what the collectives wait before failing)."""
    init_process_group(*args, **kwargs)
    group = torch.distributed.distributed_c10d._get_default_group()
    timeout = group._get_backend(torch.device("cpu")).options._timeout
    record = Path(os.environ["CRAM_TEST_GROUP_TIMEOUT_DIR"]) / f"rank-{torch.distributed.get_rank()}.json"
    record.write_text(json.dumps({"timeout_seconds": timeout.total_seconds()}))


prepare_module._build = slow_build
torch.distributed.init_process_group = recording_init_process_group
sys.argv = [str(RECIPE), *sys.argv[1:]]
runpy.run_path(str(RECIPE), run_name="__main__")
