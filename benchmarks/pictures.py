"""
The docs' two pictures, drawn from runs made here on the CPU (about a minute on 2 cores):

    python -m benchmarks.pictures 2>/dev/null            # writes docs/images/loss_curves.png and gathered_bytes.png
    python -m benchmarks.pictures --out_dir /tmp/pictures --steps 4

1. `loss_curves.png`: the logged training loss of every step of a tiny BERT classifier (the tests' classifier with a
   wide initialisation, 32 rows with random labels that it learns by heart, 8 rows per optimizer step, plain SGD, the
   same rows and seed everywhere), trained by one process, with gradient accumulation 2, on 2 DDP ranks (real gloo
   processes) and under torch's DataParallel on 4 emulated devices (`hf_parallel.testing`), by stock
   `transformers.Trainer` and by `hf_parallel.Trainer`.
2. `gathered_bytes.png`: the bytes one DataParallel step brings to GPU 0 (`benchmarks.gathered`, second step), for a
   causal LM at several vocabulary sizes, stock against hf_parallel with the even split and with `gpu0_bsz`.

Every figure drawn is also printed.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import warnings
from pathlib import Path

import transformers

from benchmarks.gathered import configurations, step_bytes
from tests.helpers.harness import Topology, run_case, run_ddp_runs
from tests.helpers.heads import Case
from tests.helpers.tiny import classification_rows, tiny_bert_classifier


def _classifier(seed: int):
    # A wide initialisation puts the logits far from uniform, so the rows' losses differ and a wrong average shows.
    return tiny_bert_classifier(seed, initializer_range=0.5)


def _rows(n: int, seed: int) -> list[dict]:
    return classification_rows(n, seed=seed).rows


CASE = Case("bert_classifier_wide_init", _classifier, _rows)  # module-level functions: the DDP ranks unpickle it
BATCH = 8  # rows per optimizer step, in every topology
ROWS = 32  # 4 optimizer steps an epoch
# label -> (topology, stock); the DDP runs are spawned together, the others run in this process.
TOPOLOGIES = {
    "one process, 8 rows": Topology("one process", per_device=BATCH),
    "gradient accumulation 2 x 4": Topology("GA 2", per_device=4, accumulation=2),
    "DDP, 2 ranks x 4": Topology("DDP 2", per_device=4, processes=2),
    "DataParallel, 4 devices, split [2, 2, 2, 2]": Topology("DP 4", per_device=2, dp_devices=4),
    "DataParallel, 4 devices, gpu0_bsz=1: [1, 3, 2, 2]": Topology("DP 4 balanced", 2, dp_devices=4, gpu0_bsz=1),
}
VOCAB_SIZES = (1000, 4000, 16000, 32000)
DEVICES = 3


def loss_curves(steps: int) -> dict[tuple[str, bool], list[float]]:
    """(topology label, stock) -> the logged loss of each step. Stock has no `gpu0_bsz`: only its even split runs."""
    overrides = dict(train_rows=ROWS, max_steps=steps, eval_rows=0, learning_rate=0.1)
    runs = {
        (label, stock): topology
        for label, topology in TOPOLOGIES.items()
        for stock in (True, False)
        if not (stock and topology.gpu0_bsz is not None)
    }
    spawned = {repr(key): (CASE, t, key[1], overrides) for key, t in runs.items() if t.processes > 1}
    with tempfile.TemporaryDirectory() as tmp:
        ddp = run_ddp_runs(spawned, tmp) if spawned else {}
    curves = {}
    for key, topology in runs.items():
        result = ddp[repr(key)] if topology.processes > 1 else run_case(CASE, topology, stock=key[1], **overrides)
        curves[key] = result.losses
    return curves


def draw_loss_curves(curves: dict[tuple[str, bool], list[float]], path: Path) -> None:
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    styles = dict(zip(TOPOLOGIES, ("-", "--", "-.", ":", (0, (1, 4))), strict=True))
    markers = dict(zip(TOPOLOGIES, ("o", "s", "^", "D", "x"), strict=True))
    for axis, stock, title in ((axes[0], True, "stock transformers.Trainer"), (axes[1], False, "hf_parallel.Trainer")):
        for label in TOPOLOGIES:
            if (label, stock) not in curves:
                continue
            losses = curves[label, stock]
            steps = range(1, len(losses) + 1)
            axis.plot(steps, losses, linestyle=styles[label], marker=markers[label], markersize=4, label=label)
        axis.set_title(title)
        axis.set_xlabel("optimizer step (8 rows each; the same rows and seed in every run)")
        axis.grid(alpha=0.3)
    axes[0].set_ylabel("logged training loss")
    axes[1].legend(fontsize=8, loc="upper right")
    figure.suptitle("Tiny BERT classifier, plain SGD: the logged loss of each step, by how the step is split")
    figure.tight_layout()
    figure.savefig(path, dpi=110, metadata={"Software": None})
    plt.close(figure)


def gathered(vocab_sizes: tuple[int, ...]) -> dict[str, list[int]]:
    """Configuration label -> the bytes of the second DataParallel step at each vocabulary size."""
    figures = {label: [] for label in configurations(DEVICES)}
    for vocab_size in vocab_sizes:
        for label, (topology, stock) in configurations(DEVICES).items():
            figures[label].append(step_bytes(vocab_size, topology, stock).later)
    return figures


def draw_gathered(vocab_sizes: tuple[int, ...], figures: dict[str, list[int]], path: Path) -> None:
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7.5, 4.2))
    for (label, values), marker in zip(figures.items(), ("o", "s", "^", "D"), strict=True):
        axis.plot(vocab_sizes, values, marker=marker, label=label)
    axis.set_xscale("log")
    axis.set_yscale("log")
    axis.set_xticks(vocab_sizes, [f"{v:,}" for v in vocab_sizes])
    axis.set_xlabel("vocabulary size")
    axis.set_ylabel("bytes gathered on GPU 0 per step")
    axis.set_title(f"Causal LM, 9 rows x 8 tokens, DataParallel on {DEVICES} emulated devices (second step)")
    axis.grid(alpha=0.3, which="both")
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110, metadata={"Software": None})
    plt.close(figure)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out_dir", default=str(Path(__file__).resolve().parent.parent / "docs" / "images"))
    parser.add_argument("--steps", type=int, default=16, help="optimizer steps of each loss curve")
    parser.add_argument("--vocab_sizes", type=int, nargs="+", default=list(VOCAB_SIZES))
    args = parser.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ["PYTHONWARNINGS"] = "ignore"  # the DDP ranks are fresh processes
    os.environ["TRANSFORMERS_VERBOSITY"] = "error"
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    curves = loss_curves(args.steps)
    print("logged loss per step (stock / hf_parallel):")
    for (label, stock), losses in curves.items():
        print(f"  {'stock' if stock else 'hf_parallel':<12} {label:<50} " + " ".join(f"{x:.4f}" for x in losses))
    draw_loss_curves(curves, out_dir / "loss_curves.png")

    vocab_sizes = tuple(args.vocab_sizes)
    figures = gathered(vocab_sizes)
    print("bytes gathered on GPU 0 by the second DataParallel step, by vocabulary size " + str(list(vocab_sizes)))
    for label, values in figures.items():
        print(f"  {label:<28} " + " ".join(f"{v:,}" for v in values))
    draw_gathered(vocab_sizes, figures, out_dir / "gathered_bytes.png")
    print(f"wrote {out_dir / 'loss_curves.png'} and {out_dir / 'gathered_bytes.png'}")


if __name__ == "__main__":
    main()
