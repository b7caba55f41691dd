"""Optional dependencies stay optional: each one hidden (as if not installed) gives one sentence naming its extra,
and a 1-GPU-style run (one process, no launcher) trains without any of them."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest
from launching import run

from cram.errors import UserError
from cram.eval.causal_lm import run_lm_eval
from cram.eval.glue_report import task_metrics
from cram.train.run_options import RunOptions, check_run_options

REPO = Path(__file__).resolve().parents[1]
# Import names of every optional dependency; `None` in sys.modules makes `import X` fail as if X were missing.
OPTIONAL_MODULES = ("deepspeed", "bitsandbytes", "wandb", "tensorboard", "lm_eval", "peft", "sklearn", "scipy")


def hide(monkeypatch, *modules: str) -> None:
    for module in modules:
        monkeypatch.setitem(sys.modules, module, None)


def test_glue_metrics_without_scikit_learn_or_scipy_name_the_glue_extra(monkeypatch):
    predictions, labels = np.array([[0.1, 0.9], [0.8, 0.2]]), np.array([1, 0])
    assert task_metrics("sst2", predictions, labels) == {"accuracy": 1.0}
    for module in ("sklearn.metrics", "scipy.stats"):
        with monkeypatch.context() as hidden:
            hide(hidden, module)
            with pytest.raises(UserError) as missing:
                task_metrics("sst2", predictions, labels)
            package = "scikit-learn" if module.startswith("sklearn") else "scipy"
            assert str(missing.value) == (
                f'GLUE\'s metrics needs {package}, which is not installed: pip install "cram[glue]".')


def test_lm_eval_tasks_without_lm_eval_name_its_extra(monkeypatch, tmp_path):
    hide(monkeypatch, "lm_eval")
    with pytest.raises(UserError, match=r'^scoring lm-eval --tasks needs lm-eval, which is not installed: pip install '
                                        r'"cram\[lm-eval\]"\.$'):
        run_lm_eval(tmp_path, ["lambada_openai"])


@pytest.mark.parametrize("tracker", ["wandb", "tensorboard"])
def test_a_tracker_that_is_not_installed_is_refused_before_the_run_names_its_extra(monkeypatch, tracker):
    if importlib.util.find_spec(tracker) is not None:  # installed (the floors job installs no tracker)
        check_run_options(RunOptions(report_to=tracker))
    hide(monkeypatch, tracker)
    with pytest.raises(UserError, match=rf'^--report-to {tracker} needs {tracker}, .* pip install "cram\[{tracker}\]"'):
        check_run_options(RunOptions(report_to=tracker))


@pytest.mark.slow
def test_a_one_process_cram_run_trains_with_every_optional_dependency_missing(tmp_path, recipe_env):
    hidden_run = (
        "import runpy, sys\n"
        f"for module in {OPTIONAL_MODULES!r}:\n"
        "    sys.modules[module] = None\n"
        "sys.argv = sys.argv[1:]\n"
        "runpy.run_path(sys.argv[0], run_name='__main__')\n"
    )
    command = [sys.executable, "-c", hidden_run, str(REPO / "recipes" / "cram.py"), "--preset", "tiny",
               "--max-steps", "2", "--micro-batch-size", "8", "--target-batch-size", "16", "--output-dir", tmp_path]
    # A fresh interpreter: a zygote's child would start with the optional modules imported, and with what its
    # libraries concluded at import about their presence.
    completed = run(command, env=recipe_env, fresh=True)
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert (tmp_path / "final" / "model.safetensors").is_file()
