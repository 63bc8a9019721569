"""Run under `torchrun --nproc_per_node 2` on a machine without GPUs and WITHOUT use_cpu (the mis-launch).

First the control: stock `transformers.Trainer` trains, each rank on its own data, and its copies drift apart
(no gradient is exchanged) while the launch would exit 0. Then `hf_parallel.Trainer` on the same launch must stop
with a RuntimeError before training. Each rank writes what it saw to `<out>/rank<R>.json`.

    PYTHONPATH=. torchrun --nproc_per_node 2 tests/distributed/mislaunch_worker.py OUT_DIR
"""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import transformers

import hf_parallel
from tests.helpers.harness import training_args
from tests.helpers.tiny import classification_rows, tiny_bert_classifier


def args_for(cls, out: Path):
    # use_cpu unset, as in the launch this worker shows.
    return training_args(
        out, args_cls=cls, use_cpu=False, per_device_train_batch_size=4, max_steps=3, learning_rate=1e-2
    )


def main() -> None:
    out = Path(sys.argv[1])
    rank = int(os.environ["RANK"])
    report = {"env_world_size": int(os.environ["WORLD_SIZE"]), "rank": rank}

    # Control: stock transformers. Each rank gets different rows, as a sharded sampler would give it.
    stock_args = args_for(transformers.TrainingArguments, out / "stock")
    report["stock_world_size"] = stock_args.world_size
    report["stock_parallel_mode"] = stock_args.parallel_mode.value
    # accelerate formed a process group (backend=None picks gloo) and then ignored it: DistributedType.NO.
    report["process_group_world_size"] = dist.get_world_size() if dist.is_initialized() else None
    stock = transformers.Trainer(
        model=tiny_bert_classifier(seed=0),
        args=stock_args,
        train_dataset=classification_rows(24, seed=100 + rank),
    )
    stock.train()
    report["stock_trained_steps"] = stock.state.global_step
    report["stock_wrapped_in_ddp"] = isinstance(stock.model_wrapped, torch.nn.parallel.DistributedDataParallel)
    flat = torch.cat([p.detach().flatten() for p in stock.model.parameters()])
    gathered = [torch.zeros_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    report["stock_max_param_diff_across_ranks"] = (gathered[0] - gathered[1]).abs().max().item()

    # hf_parallel on the same launch: a clear error before training.
    try:
        hf_parallel.Trainer(
            model=tiny_bert_classifier(seed=0),
            args=args_for(hf_parallel.TrainingArguments, out / "hf_parallel"),
            train_dataset=classification_rows(24, seed=100 + rank),
        )
        report["hf_parallel_error"] = None
    except RuntimeError as error:
        report["hf_parallel_error"] = str(error)

    (out / f"rank{rank}.json").write_text(json.dumps(report))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
