"""What the GPU lane's modules share: a tiny BERT built from a config (nothing is downloaded: the GPU machine has
no network) and small synthetic classification data."""

from __future__ import annotations

import torch


def tiny_bert(seed: int = 0, dropout: float = 0.1, layers: int = 2, hidden: int = 32) -> torch.nn.Module:
    """BertForSequenceClassification from a config: vocabulary 128, `layers` layers of width `hidden`, 2 labels."""
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(seed)
    config = BertConfig(vocab_size=128, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=2,
                        intermediate_size=2 * hidden, max_position_embeddings=64, hidden_dropout_prob=dropout,
                        attention_probs_dropout_prob=dropout, num_labels=2)
    return BertForSequenceClassification(config)


def bert_rows(n: int, seq: int = 16, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """`n` examples (input_ids, attention_mask, labels) on the CPU, the label a function of the tokens."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 128, (n, seq), generator=generator)
    labels = (ids[:, 0] % 2).long()
    return [{"input_ids": ids[i], "attention_mask": torch.ones(seq, dtype=torch.long), "labels": labels[i]}
            for i in range(n)]
