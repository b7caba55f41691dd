"""Raw text to a cached `datasets.Dataset` of fixed-length token blocks, with its WordPiece tokenizer.

    prepared = prepare(DataOptions(sources=["corpus/"], vocab_size=32768, seq_len=128))
    prepared.dataset        # column "input_ids", every row exactly seq_len ids
    prepared.tokenizer      # PreTrainedTokenizerFast, [PAD]=0 [UNK]=1 [CLS]=2 [SEP]=3 [MASK]=4
"""

from cram.data.corpus import embedded_corpus_path
from cram.data.options import SPECIAL_TOKENS, DataOptions
from cram.data.prepare import PreparedData, is_prepared, load_prepared, prepare, prepared_path

__all__ = [
    "SPECIAL_TOKENS",
    "DataOptions",
    "PreparedData",
    "embedded_corpus_path",
    "is_prepared",
    "load_prepared",
    "prepare",
    "prepared_path",
]
