"""cram: pretrain language models from scratch on one GPU or a small node.

Importing `cram` registers the crammed-BERT classes with the `transformers` Auto classes.
"""

import logging

from cram.models.crammed_bert import (
    CrammedBertConfig,
    CrammedBertForMaskedLM,
    CrammedBertForSequenceClassification,
    CrammedBertModel,
)

# transformers' Trainer imports peft, which imports bitsandbytes; on CPUs with AVX512-BF16 that import warns about
# an optional 4-bit kernel package (whatever the import order: the logger is looked up by name). No cram path
# uses 4-bit, and the notice would come before a refused input's one-line error.
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)

__all__ = [
    "CrammedBertConfig",
    "CrammedBertForMaskedLM",
    "CrammedBertForSequenceClassification",
    "CrammedBertModel",
]
__version__ = "0.1.0"
