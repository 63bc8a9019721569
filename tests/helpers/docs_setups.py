"""
What the docs' code blocks take as given (`model`, `train_ds`, ...), by setup name (tests/helpers/docs_blocks.py): tiny
models built from configs and rows made in code, as every test uses. Each setup gets an ExitStack for what it must
undo, and the page's working folder.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch
import torch.distributed as dist

from tests.helpers.heads import CASES, lm_rows, seq2seq_rows
from tests.helpers.tiny import ListDataset, classification_rows, tiny_bert_classifier


def classifier(stack: contextlib.ExitStack, workdir: Path) -> dict:
    """A tiny BERT classifier (vocabulary 50, 2 labels) and 16 training / 8 evaluation rows of 8 tokens."""
    train = classification_rows(16, seed=0)
    return dict(model=tiny_bert_classifier(0), train_ds=train, ds=train, eval_ds=classification_rows(8, seed=1))


def causal_lm(stack: contextlib.ExitStack, workdir: Path) -> dict:
    """A tiny Llama, its rows (`train_ds`), the same as a `datasets.Dataset` of token ids (`ds`) and a tokenizer."""
    import datasets

    from examples.train import word_tokenizer

    rows = lm_rows(8, 1)
    texts = datasets.Dataset.from_list(
        [{"input_ids": r["input_ids"][r["attention_mask"].bool()].tolist()} for r in rows]
    )
    return dict(model=CASES["llama_causal_lm"].build(0), train_ds=ListDataset(rows), ds=texts, tok=word_tokenizer())


def seq2seq(stack: contextlib.ExitStack, workdir: Path) -> dict:
    """A tiny BART and its training and evaluation rows."""
    return dict(
        seq2seq_model=CASES["bart_seq2seq"].build(0),
        seq2seq_train=ListDataset(seq2seq_rows(8, 1)),
        seq2seq_eval=ListDataset(seq2seq_rows(5, 2)),
    )


def ddp_loop(stack: contextlib.ExitStack, workdir: Path) -> dict:
    """A tiny Llama in DistributedDataParallel over a one-process gloo group, its dataloader and an optimizer."""
    store = dist.FileStore(str(workdir / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    stack.callback(dist.destroy_process_group)
    model = CASES["llama_causal_lm"].build(0)
    ddp_model = torch.nn.parallel.DistributedDataParallel(model)
    loader = torch.utils.data.DataLoader(ListDataset(lm_rows(8, 1)), batch_size=2)
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=0.1)
    return dict(ddp_model=ddp_model, train_dataloader=loader, optimizer=optimizer, device=torch.device("cpu"))


@contextlib.contextmanager
def _environment(**values: str):
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def deepspeed_loop(stack: contextlib.ExitStack, workdir: Path) -> dict:
    """A tiny Llama in a DeepSpeed ZeRO-2 engine (GA 2) over a one-process gloo group, and its dataloader."""
    import pytest

    deepspeed = pytest.importorskip("deepspeed", reason='deepspeed is not installed: pip install -e ".[deepspeed]"')
    if not dist.is_initialized():  # the page's torchrun block may have made it
        ddp_loop(stack, workdir)
    # DeepSpeed reads the launcher's variables even when the process group exists.
    stack.enter_context(_environment(LOCAL_RANK="0", RANK="0", WORLD_SIZE="1"))
    model = CASES["llama_causal_lm"].build(0)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "zero_optimization": {"stage": 2},
        "zero_allow_untested_optimizer": True,
    }
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    loader = torch.utils.data.DataLoader(ListDataset(lm_rows(8, 1)), batch_size=2)
    return dict(engine=engine, train_dataloader=loader)


def masked_lm(stack: contextlib.ExitStack, workdir: Path) -> dict:
    """examples/embed.py's tiny masked LM and character tokenizer, and 6 tokenized DNA reads."""
    from examples import embed

    tokenizer = embed.char_tokenizer()
    reads = ["ACGTACGTAA", "CCGGTTA", "ACGT", "TTTTACGGACGT", "GATTACA", "ACGTACGTACGTAC"]
    encoded = tokenizer(reads)
    rows = [{key: encoded[key][i] for key in ("input_ids", "attention_mask")} for i in range(len(reads))]
    return dict(model=embed.tiny_masked_lm(tokenizer, max_length=40, seed=0), tokenizer=tokenizer, tokenized_rows=rows)


def preference(stack: contextlib.ExitStack, workdir: Path) -> dict:
    """TRL's preference data: a tiny Llama (`model`) and its reference (`ref_model`), a tiny reward model, 8 pairs of
    strings (`pairs`: prompt, chosen, rejected; `implicit_pairs`: the prompt inside each), 8 texts (`texts`), 8 prompts
    (`prompts`) and a word tokenizer."""
    import datasets

    from tests.helpers import trl_runs

    return dict(
        model=trl_runs.causal_lm(0), ref_model=trl_runs.causal_lm(1), reward_model=trl_runs.reward_model(0),
        pairs=datasets.Dataset.from_list(trl_runs.dataset_rows("preference", 8)),
        implicit_pairs=datasets.Dataset.from_list(trl_runs.dataset_rows("implicit_preference", 8)),
        texts=datasets.Dataset.from_list(trl_runs.dataset_rows("language_modeling", 8)), tok=trl_runs.tokenizer(),
        prompts=datasets.Dataset.from_list(trl_runs.dataset_rows("prompt_only", 8)),
    )  # fmt: skip


SETUPS = {
    setup.__name__: setup
    for setup in (classifier, causal_lm, seq2seq, ddp_loop, deepspeed_loop, masked_lm, preference)
}
