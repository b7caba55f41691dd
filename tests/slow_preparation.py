"""Run recipes/cram.py (with the arguments given) with every data preparation slowed by
$CRAM_TEST_PREPARATION_SECONDS, standing in for a corpus that takes hours to prepare."""

import importlib
import os
import runpy
import sys
import time
from pathlib import Path

prepare_module = importlib.import_module("cram.data.prepare")  # `cram.data.prepare` is also the function's name

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "cram.py"
build = prepare_module._build


def slow_build(*args, **kwargs):
    time.sleep(float(os.environ["CRAM_TEST_PREPARATION_SECONDS"]))
    return build(*args, **kwargs)


prepare_module._build = slow_build
sys.argv = [str(RECIPE), *sys.argv[1:]]
runpy.run_path(str(RECIPE), run_name="__main__")
