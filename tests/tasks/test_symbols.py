"""The compact vocabulary (tasks/symbols.py): ids in order, its own ids for its symbols, the
block of ordinary ids of another tokenizer, and the errors."""

from __future__ import annotations

import pytest

from attnlab.tasks.symbols import (
    BYTE_NAMES,
    FOREIGN_FIRST,
    SPECIALS,
    number_names,
    symbol_ids,
    symbol_tokenizer,
)


def test_compact_vocabulary_ids_and_padding():
    tok = symbol_tokenizer(BYTE_NAMES)
    assert len(tok) == len(SPECIALS) + 256
    assert (tok.pad_token_id, tok.unk_token_id, tok.cls_token_id, tok.sep_token_id,
            tok.mask_token_id) == (0, 1, 2, 3, 4)
    assert symbol_ids(tok, BYTE_NAMES) == list(range(5, 261))  # byte b -> 5 + b
    padded = tok.pad([{"input_ids": [2, 7, 3]}, {"input_ids": [2, 3]}], return_tensors="pt")
    assert padded["input_ids"].tolist() == [[2, 7, 3], [2, 3, 0]]
    assert padded["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]


def test_a_tokenizer_without_the_symbols_lends_a_block(tokenizer):
    ids = symbol_ids(tokenizer, BYTE_NAMES)  # BERT's WordPiece has no "<0x41>"
    assert ids == list(range(FOREIGN_FIRST, FOREIGN_FIRST + 256))
    assert not set(ids) & set(tokenizer.all_special_ids)
    digits = symbol_ids(tokenizer, number_names(10))  # names it has: its own ids
    assert digits == tokenizer.convert_tokens_to_ids([str(i) for i in range(10)])
    with pytest.raises(ValueError, match="cannot stand for them"):
        symbol_ids(tokenizer, number_names(len(tokenizer)))  # the block would not fit


def test_bad_names_are_refused():
    with pytest.raises(ValueError, match="appears twice"):
        symbol_tokenizer(["a", "b", "a"])
    with pytest.raises(ValueError, match="appears twice"):
        symbol_tokenizer(["[CLS]"])
    with pytest.raises(ValueError, match="whitespace"):
        symbol_tokenizer(["a b"])
