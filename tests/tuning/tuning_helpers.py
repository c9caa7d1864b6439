"""Tiny random BERT / RoBERTa models and hand-written batches for the tuner tests."""

from __future__ import annotations

import torch

CLS, SEP, PAD = 101, 102, 0  # BERT WordPiece ids
BOS, EOS, RPAD = 0, 2, 1  # RoBERTa ids


def make_bert(head: str = "seq", num_labels: int = 3, seed: int = 0):
    from transformers import (
        BertConfig,
        BertForQuestionAnswering,
        BertForSequenceClassification,
        BertForTokenClassification,
        BertModel,
    )

    cfg = BertConfig(vocab_size=120, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=32, max_position_embeddings=64,
                     num_labels=2 if head == "qa" else num_labels)
    cls = {"seq": BertForSequenceClassification, "tok": BertForTokenClassification,
           "qa": BertForQuestionAnswering, "base": BertModel}[head]
    torch.manual_seed(seed)
    return cls(cfg)


def make_roberta(seed: int = 0):
    from transformers import RobertaConfig, RobertaForSequenceClassification

    cfg = RobertaConfig(vocab_size=60, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=40, type_vocab_size=1,
                        pad_token_id=RPAD, bos_token_id=BOS, eos_token_id=EOS, num_labels=2)
    torch.manual_seed(seed)
    return RobertaForSequenceClassification(cfg)


def bert_pair_batch() -> dict[str, torch.Tensor]:
    """Three pair inputs, [SEP]s at different places, padding (one [SEP] id under padding)."""
    ids = torch.tensor([
        [CLS, 5, 6, SEP, 7, 8, 9, SEP, PAD],
        [CLS, 5, SEP, 6, 7, SEP, PAD, SEP, PAD],  # the SEP at 7 is masked out: not special
        [CLS, 5, 6, 7, 8, SEP, 9, 10, SEP],
    ])
    mask = torch.tensor([
        [1, 1, 1, 1, 1, 1, 1, 1, 0],
        [1, 1, 1, 1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 1, 1, 1, 1, 1],
    ])
    types = torch.tensor([
        [0, 0, 0, 0, 1, 1, 1, 1, 0],
        [0, 0, 0, 1, 1, 1, 0, 0, 0],
        [0, 0, 0, 0, 0, 0, 1, 1, 1],
    ])
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": types}


# Row of e_s at each position of bert_pair_batch (-1: no vector).
BERT_PAIR_INDEX = torch.tensor([
    [0, -1, -1, 1, -1, -1, -1, 2, -1],
    [0, -1, 1, -1, -1, 2, -1, -1, -1],
    [0, -1, -1, -1, -1, 1, -1, -1, 2],
])


def roberta_pair_batch() -> dict[str, torch.Tensor]:
    """<s> A </s></s> B </s>, padded with id 1."""
    ids = torch.tensor([
        [BOS, 5, 6, EOS, EOS, 7, EOS, RPAD, RPAD],
        [BOS, 5, EOS, EOS, 6, 7, 8, 9, EOS],
    ])
    mask = (ids != RPAD).long()
    return {"input_ids": ids, "attention_mask": mask}


ROBERTA_PAIR_INDEX = torch.tensor([
    [0, -1, -1, 1, 2, -1, 3, -1, -1],
    [0, -1, 1, 2, -1, -1, -1, -1, 3],
])


TINY = dict(vocab_size=60, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
            intermediate_size=32, max_position_embeddings=40)
# family -> (class-name prefix, config keywords) of the other hosts' tiny models
FAMILIES = {
    "xlm-roberta": ("XLMRoberta", dict(TINY, type_vocab_size=1, pad_token_id=RPAD,
                                       bos_token_id=BOS, eos_token_id=EOS)),
    "camembert": ("Camembert", dict(TINY, type_vocab_size=1, pad_token_id=RPAD,
                                    bos_token_id=BOS, eos_token_id=EOS)),
    "roberta": ("Roberta", dict(TINY, type_vocab_size=1, pad_token_id=RPAD, bos_token_id=BOS,
                                eos_token_id=EOS)),
    "distilbert": ("DistilBert", dict(vocab_size=60, dim=16, n_layers=2, n_heads=2,
                                      hidden_dim=32, max_position_embeddings=40)),
    "modernbert": ("ModernBert", dict(TINY, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                      cls_token_id=1, sep_token_id=2)),
    "data2vec-text": ("Data2VecText", dict(TINY, pad_token_id=RPAD)),
}


def make_family(family: str, head: str = "ForSequenceClassification", seed: int = 0,
                **overrides):
    """A tiny random model of another family ("Model": the bare encoder), 2 labels."""
    import transformers

    prefix, values = FAMILIES[family]
    config = getattr(transformers, prefix + "Config")(**{**values, **overrides})
    config.num_labels = 2
    torch.manual_seed(seed)
    return getattr(transformers, prefix + head)(config)
