"""The compact vocabulary of symbol-level tasks: one home for it.

Tasks whose inputs are symbols rather than words (``recall``: token ids of an associative
recall sequence; ``text``: bytes; ``listops`` when an encoder is trained from scratch on it)
need no 30,522-word WordPiece table. ``symbol_tokenizer(names)`` builds the smallest
vocabulary that holds them: the five BERT specials, then one token per symbol name::

    id 0 [PAD]   1 [UNK]   2 [CLS]   3 [SEP]   4 [MASK]   5.. the names, in order

as a Hugging Face fast tokenizer (a ``tokenizers`` WordLevel model), so padding, the
collators and ``save_pretrained`` work as with any tokenizer. A from-scratch encoder for it
takes ``vocab_size=len(tokenizer)`` (``models.encoder_config(..., vocab_size=...)``).

Symbol names: ``BYTE_NAMES`` for the 256 byte values (``<0x00>`` .. ``<0xFF>``, the
byte-fallback spelling of SentencePiece), ``number_names(n)`` for the ids 0..n-1 of a
synthetic task, and ListOps's own words (``listops.VOCAB_WORDS``).

``symbol_ids(tokenizer, names)`` is how a task maps its symbols to input ids with *any*
tokenizer: each name's own id where every name is one token of the tokenizer (the compact
vocabulary above), else a fixed block of ordinary ids ``FOREIGN_FIRST ..
FOREIGN_FIRST + len(names) - 1``, which must hold no special token. The block lets
``attnlab run`` train these tasks with ``model.name: scratch:SIZE`` (the embedded BERT
tokenizer, 30,522 ids): a randomly initialised encoder only needs distinct ids. The ids mean
nothing to a pretrained model's embeddings.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")  # ids 0..4 of the compact vocabulary
BYTE_NAMES = tuple(f"<0x{b:02X}>" for b in range(256))  # byte b -> symbol name
# First id of the block a tokenizer without the symbols lends: past the [PAD], [unusedN],
# [UNK], [CLS], [SEP] and [MASK] ids (0-998) of BERT's uncased WordPiece vocabulary.
FOREIGN_FIRST = 1000


def number_names(n: int) -> tuple[str, ...]:
    """Names of the symbols 0..n-1 of a synthetic task: ``"0"``, ``"1"``, ..."""
    return tuple(str(i) for i in range(n))


def symbol_tokenizer(names: Sequence[str]) -> Any:
    """A fast tokenizer over ``SPECIALS`` then ``names`` (see the module docstring).

    Names must be distinct, non-empty and free of whitespace (the pre-tokenizer splits on
    it), and must not repeat a special token.
    """
    # heavy: tokenizers and transformers, imported on use (the CLI imports tasks at start)
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    names = list(names)
    bad = next((n for n in names if not n or n != "".join(n.split())), None)
    if bad is not None:
        raise ValueError(f"symbol name {bad!r} is empty or holds whitespace; a symbol is "
                         "one whitespace-free token")
    vocab: dict[str, int] = {}
    for tok in (*SPECIALS, *names):
        if tok in vocab:
            raise ValueError(f"symbol name {tok!r} appears twice (or repeats a special "
                             f"token of {SPECIALS}); give each symbol one distinct name")
        vocab[tok] = len(vocab)
    core = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=core, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
        sep_token="[SEP]", mask_token="[MASK]", model_input_names=["input_ids",
                                                                     "attention_mask"])


def symbol_ids(tokenizer: Any, names: Sequence[str]) -> list[int]:
    """Input id of each name in ``tokenizer``: its own token ids where it has every name
    as one token, else the block ``FOREIGN_FIRST + i`` (see the module docstring).

    Raises ValueError when the tokenizer is too small for the block or has a special token
    inside it.
    """
    names = list(names)
    own = tokenizer.convert_tokens_to_ids(names)
    unk = getattr(tokenizer, "unk_token_id", None)
    if all(i is not None and i != unk for i in own) and len(set(own)) == len(own):
        return list(own)
    size = len(tokenizer)
    block = range(FOREIGN_FIRST, FOREIGN_FIRST + len(names))
    special = sorted(i for i in getattr(tokenizer, "all_special_ids", ()) if i in block)
    if block.stop > size or special:
        why = (f"has only {size} ids" if block.stop > size
               else f"has special tokens at ids {special[:5]}")
        raise ValueError(
            f"this tokenizer lacks the task's {len(names)} symbols and {why}, so the ids "
            f"{block.start}..{block.stop - 1} cannot stand for them; use the compact "
            "vocabulary (attnlab.tasks.symbols.symbol_tokenizer) with a from-scratch "
            "encoder of vocab_size=len(tokenizer)")
    return list(block)
