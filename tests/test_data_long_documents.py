"""Book-length documents are tokenized exactly as a whole (they are read in windows cut at whitespace).
Their memory bound is in test_data_memory.py."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from cram.data.pack import DocumentTokenizer
from cram.data.tokenizer import train_wordpiece

SEP_ID = 3


def test_a_long_document_read_in_windows_gets_the_ids_of_the_whole(english_texts):
    tokenizer = train_wordpiece(english_texts[:300], 2000, True, 128, False).backend_tokenizer
    book = "\n\n".join(english_texts)
    documents = english_texts[:50] + [book] + english_texts[50:100]
    whole = np.concatenate([np.array([*encoding.ids, SEP_ID], dtype=np.uint16)
                            for encoding in tokenizer.encode_batch_fast(documents, add_special_tokens=False)])
    windowed = DocumentTokenizer(tokenizer, SEP_ID, np.dtype(np.uint16), max_chars=20_000)(
        pa.table({"text": pa.array(documents, pa.large_string())}))
    assert len(book) > 10 * 20_000
    np.testing.assert_array_equal(windowed.column("ids")[0].values.to_numpy(), whole)
