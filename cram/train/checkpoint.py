"""Write a Hugging Face checkpoint folder atomically: a temporary name first, renamed when complete."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from transformers import PreTrainedModel, PreTrainedTokenizerBase

OPTIONS_FILE = "cram_options.json"


def save_checkpoint(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, options: dict, directory: str | Path
) -> Path:
    """Save model, tokenizer and the resolved recipe options to `directory`, replacing any older checkpoint there.

    A run killed while saving leaves only `<directory>.tmp`, never a folder that looks like a finished checkpoint.
    """
    directory = Path(directory)
    staging = directory.with_name(directory.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging, safe_serialization=True)
    tokenizer.save_pretrained(staging)
    (staging / OPTIONS_FILE).write_text(json.dumps(options, indent=2, default=str) + "\n")
    if directory.exists():
        retired = directory.with_name(directory.name + ".old")
        shutil.rmtree(retired, ignore_errors=True)
        directory.rename(retired)
        staging.rename(directory)
        shutil.rmtree(retired)
    else:
        staging.rename(directory)
    return directory
