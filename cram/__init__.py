"""cram: pretrain language models from scratch on one GPU or a small node.

Importing `cram` registers the crammed-BERT classes with the `transformers` Auto classes.
"""

from cram.models.crammed_bert import (
    CrammedBertConfig,
    CrammedBertForMaskedLM,
    CrammedBertForSequenceClassification,
    CrammedBertModel,
)

__all__ = [
    "CrammedBertConfig",
    "CrammedBertForMaskedLM",
    "CrammedBertForSequenceClassification",
    "CrammedBertModel",
]
__version__ = "0.1.0"
