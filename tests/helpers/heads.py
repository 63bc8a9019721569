"""
One tiny model and one dataset per loss head (`CASES`), for the equivalence matrix of the exact loss, and the
classifier (`CLASSIFIER`) of the tests of how a batch is split.

Every case of the matrix has uneven numbers of valid items per row (padding, ignored labels, out-of-range answer
positions), so a split of the batch that averages per-device means is visibly wrong, and at least one row with no
valid item.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import (
    BartConfig,
    BartForConditionalGeneration,
    BertForMaskedLM,
    BertForMultipleChoice,
    BertForQuestionAnswering,
    BertForSequenceClassification,
    BertForTokenClassification,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
)

from tests.helpers.tiny import VOCAB, ListDataset, classification_rows, tiny, tiny_bert_classifier, tiny_bert_config

SEQ = 8
NUM_LABELS = 3


def _gpt2(seed: int):
    torch.manual_seed(seed)
    return GPT2LMHeadModel(tiny(GPT2Config))


def llama(seed: int, **config):
    """The tiny Llama of the matrix; `config` overrides its settings (e.g. a wider vocabulary)."""
    torch.manual_seed(seed)
    return LlamaForCausalLM(tiny(LlamaConfig, **config))


def _bart(seed: int):
    torch.manual_seed(seed)
    return BartForConditionalGeneration(tiny(BartConfig))


def _lora(build: Callable[[int], torch.nn.Module], task_type: str, target_modules: list[str]):
    """A PEFT LoRA adapter on a case's model, its adapter weights drawn at random (not the zero init of B), so
    that the first step's gradient reaches both adapter matrices."""

    def wrapped(seed: int):
        import peft

        model = build(seed)
        torch.manual_seed(seed + 1)
        config = peft.LoraConfig(
            task_type=task_type, r=4, lora_alpha=8, target_modules=target_modules, init_lora_weights=False
        )
        return peft.get_peft_model(model, config)

    return wrapped


def _bert(cls, **config):
    def build(seed: int):
        torch.manual_seed(seed)
        return cls(tiny_bert_config(**config))

    return build


def _lengths(g: torch.Generator, n: int) -> torch.Tensor:
    """Very uneven row lengths: 1..SEQ tokens, the first row a single token."""
    lengths = torch.randint(1, SEQ + 1, (n,), generator=g)
    lengths[0] = 1
    return lengths


def _padded(g: torch.Generator, n: int, lengths=None, vocab: int = VOCAB):
    seq = SEQ if lengths is None else max(lengths)
    ids = torch.randint(5, vocab, (n, seq), generator=g)
    lengths = _lengths(g, n) if lengths is None else torch.tensor(lengths)
    mask = (torch.arange(seq)[None, :] < lengths[:, None]).long()
    return ids * mask, mask


def lm_rows(n: int, seed: int, *, lengths: tuple[int, ...] | None = None, vocab: int = VOCAB) -> list[dict]:
    """
    Causal LM: labels = input_ids, -100 on padding. Row 0 has one token, so nothing to predict after the shift; or,
    with `lengths` (n of them), rows of those lengths, padded to the longest; ids below `vocab`.
    """
    g = torch.Generator().manual_seed(seed)
    ids, mask = _padded(g, n, lengths, vocab)
    labels = ids.masked_fill(mask == 0, -100)
    return [{"input_ids": ids[i], "attention_mask": mask[i], "labels": labels[i]} for i in range(n)]


def shift_label_rows(n: int, seed: int) -> list[dict]:
    """Causal LM with the targets already shifted by the collator, and fewer of them than the labels give."""
    rows = lm_rows(n, seed)
    g = torch.Generator().manual_seed(seed + 100)
    for row in rows:
        shifted = torch.nn.functional.pad(row["labels"][1:], (0, 1), value=-100)
        row["shift_labels"] = shifted.masked_fill(torch.rand(SEQ, generator=g) < 0.3, -100)
    return rows


def seq2seq_rows(n: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    ids, mask = _padded(g, n)
    target, target_mask = _padded(g, n)
    labels = target.masked_fill(target_mask == 0, -100)
    labels[0] = -100  # a row with no target at all
    return [{"input_ids": ids[i], "attention_mask": mask[i], "labels": labels[i]} for i in range(n)]


def mlm_rows(n: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    ids, mask = _padded(g, n)
    chosen = (torch.rand(n, SEQ, generator=g) < 0.4) & (mask == 1)
    chosen[0] = False
    labels = ids.masked_fill(~chosen, -100)
    return [{"input_ids": ids[i], "attention_mask": mask[i], "labels": labels[i]} for i in range(n)]


def token_rows(n: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    ids, mask = _padded(g, n)
    labels = torch.randint(0, NUM_LABELS, (n, SEQ), generator=g).masked_fill(mask == 0, -100)
    return [{"input_ids": ids[i], "attention_mask": mask[i], "labels": labels[i]} for i in range(n)]


def single_label_rows(n: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    ids, mask = _padded(g, n)
    labels = torch.randint(0, NUM_LABELS, (n,), generator=g)
    labels[0] = -100  # an ignored sample: counted out, as CrossEntropyLoss does
    return [{"input_ids": ids[i], "attention_mask": mask[i], "labels": labels[i]} for i in range(n)]


def multi_label_rows(n: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    ids, mask = _padded(g, n)
    labels = (torch.rand(n, NUM_LABELS, generator=g) < 0.5).float()
    return [{"input_ids": ids[i], "attention_mask": mask[i], "labels": labels[i]} for i in range(n)]


def regression_rows(n: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    ids, mask = _padded(g, n)
    labels = torch.randn(n, generator=g)
    return [{"input_ids": ids[i], "attention_mask": mask[i], "labels": labels[i]} for i in range(n)]


def choice_rows(n: int, seed: int, choices: int = 3) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, VOCAB, (n, choices, SEQ), generator=g)
    labels = torch.randint(0, choices, (n,), generator=g)
    labels[0] = -100
    return [{"input_ids": ids[i], "attention_mask": torch.ones_like(ids[i]), "labels": labels[i]} for i in range(n)]


def qa_rows(n: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    ids, mask = _padded(g, n)
    start = torch.randint(0, SEQ, (n,), generator=g)
    end = torch.randint(0, SEQ, (n,), generator=g)
    start[0] = SEQ + 3  # outside the input: ignored by the start term only
    end[1 % n] = SEQ  # ignored by the end term only
    return [
        {"input_ids": ids[i], "attention_mask": mask[i], "start_positions": start[i], "end_positions": end[i]}
        for i in range(n)
    ]


@dataclass(frozen=True)
class Case:
    name: str
    build: Callable[[int], torch.nn.Module]
    rows: Callable[[int, int], list[dict]]
    label_smoothing: float = 0.0
    #: The Trainer's data collator (its default when None).
    collator: Callable[[list[dict]], dict] | None = None

    def dataset(self, n: int, seed: int = 0) -> ListDataset:
        return ListDataset(self.rows(n, seed))


CASES = {
    case.name: case
    for case in (
        Case("gpt2_causal_lm", _gpt2, lm_rows),
        Case("llama_causal_lm", llama, lm_rows),
        Case("llama_shift_labels", llama, shift_label_rows),
        Case("bart_seq2seq", _bart, seq2seq_rows),
        Case("bert_masked_lm", _bert(BertForMaskedLM), mlm_rows),
        Case("bert_token_classification", _bert(BertForTokenClassification, num_labels=NUM_LABELS), token_rows),
        Case("bert_single_label", _bert(BertForSequenceClassification, num_labels=NUM_LABELS), single_label_rows),
        Case(
            "bert_multi_label",
            _bert(BertForSequenceClassification, num_labels=NUM_LABELS, problem_type="multi_label_classification"),
            multi_label_rows,
        ),
        Case("bert_regression", _bert(BertForSequenceClassification, num_labels=1), regression_rows),
        Case("bert_multiple_choice", _bert(BertForMultipleChoice), choice_rows),
        Case("bert_question_answering", _bert(BertForQuestionAnswering), qa_rows),
        Case(
            "bert_single_label_smoothing",
            _bert(BertForSequenceClassification, num_labels=NUM_LABELS),
            single_label_rows,
            label_smoothing=0.1,
        ),
        Case("gpt2_causal_lm_smoothing", _gpt2, lm_rows, label_smoothing=0.1),
        Case(
            "lora_bert_single_label",
            _lora(_bert(BertForSequenceClassification, num_labels=NUM_LABELS), "SEQ_CLS", ["query", "value"]),
            single_label_rows,
        ),
        Case("lora_llama_causal_lm", _lora(llama, "CAUSAL_LM", ["q_proj", "v_proj"]), lm_rows),
    )
}

# Not in the matrix: the tests of how a batch is split train it. A large initializer range puts the logits far from
# uniform, so the rows' losses differ and a wrong average of per-device means shows.
CLASSIFIER = Case(
    "bert_classifier_wide_init",
    lambda seed: tiny_bert_classifier(seed, initializer_range=0.5),
    lambda n, seed: classification_rows(n, seed=seed).rows,
)


def batch_of(case_name: str, rows: int = 6, seed: int = 3) -> dict[str, torch.Tensor]:
    """One collated batch of `rows` rows of a case of `CASES`."""
    dataset = CASES[case_name].dataset(rows, seed)
    return {key: torch.stack([dataset[i][key] for i in range(rows)]) for key in dataset[0]}
