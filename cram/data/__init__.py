"""Raw text to a cached `datasets.Dataset` of fixed-length token blocks, with its WordPiece tokenizer.

    prepared = prepare(DataOptions(sources=["corpus/"], vocab_size=32768, seq_len=128))
    prepared.dataset        # column "input_ids", every row exactly seq_len ids
    prepared.tokenizer      # PreTrainedTokenizerFast, [PAD]=0 [UNK]=1 [CLS]=2 [SEP]=3 [MASK]=4

Where `datasets` is not installed (a GPU image's stack: `make device-check`), the collators and the sampler
(`cram.data.collator`, `cram.data.sampling`) still import, and asking for the preparation says what it needs.
"""

from cram.data.corpus import embedded_corpus_path
from cram.data.options import SPECIAL_TOKENS, DataOptions

PREPARATION = ("PreparedData", "is_prepared", "load_prepared", "prepare", "prepared_path")
try:
    from cram.data.prepare import PreparedData, is_prepared, load_prepared, prepare, prepared_path
except ModuleNotFoundError as missing:
    if missing.name != "datasets":
        raise

    def __getattr__(name: str) -> object:
        if name in PREPARATION:
            raise ModuleNotFoundError(f"cram.data.{name} needs datasets, which is not installed: pip install datasets",
                                      name="datasets")
        raise AttributeError(f"module 'cram.data' has no attribute {name!r}")

__all__ = ["SPECIAL_TOKENS", "DataOptions", "PreparedData", "embedded_corpus_path", "is_prepared", "load_prepared",
           "prepare", "prepared_path"]
