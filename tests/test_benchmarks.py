"""
The benchmarks print figures, not verdicts; here one fast case of `benchmarks/reach.py` (the in-process part of
case 1, LoRA under gradient accumulation) is run for its figures: stock visibly off, hf_parallel on the reference.
One short run of `benchmarks/router.py`: its first step's loss against the model's own over the step's rows; and
`benchmarks/detection.py`'s gradient-accumulation half: stock's gradient off, hf_parallel's on one process's. Then the
steady-state window of `benchmarks/balance_gpu.py` (`gpu_steps.SteadyState`) and its printout, through a
stand-in for torch.cuda's memory statistics (the figures themselves need a GPU).
"""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest
import torch
from transformers import TrainerState

from benchmarks import balance_gpu, detection, gpu_steps, reach, router


def test_reach_lora_case_shows_stock_off_and_hf_parallel_exact(capsys):
    rows = reach.measure([1], ddp=False)
    figures = {(row.setup, row.figure): row for row in rows}
    assert set(figures) == {
        ("LoRA BERT cls, GA 2", "loss / ref"),
        ("LoRA BERT cls, GA 2", "update err"),
        ("LoRA Llama LM, GA 2", "eval_loss err"),
    }
    loss = figures["LoRA BERT cls, GA 2", "loss / ref"]
    assert loss.before == pytest.approx(2.0, rel=1e-3)  # stock: x2 under gradient accumulation 2
    assert abs(loss.after - 1.0) <= 1e-6
    update = figures["LoRA BERT cls, GA 2", "update err"]
    assert update.before > 0.5
    assert update.after <= 1e-6
    eval_loss = figures["LoRA Llama LM, GA 2", "eval_loss err"]
    assert eval_loss.before > 1e-4  # stock: the mean of per-batch means
    assert eval_loss.after <= 1e-6

    reach.print_table(rows)
    printed = [[text.strip() for text in line.split("|")] for line in capsys.readouterr().out.splitlines()]
    assert printed[0] == ["case", "setup", "figure", "before", "after"]
    assert printed[2][:4] == ["1", "LoRA BERT cls, GA 2", "loss / ref", "x2.000, err 1.0e+00"]
    assert printed[2][4].startswith("x1.000, err ")


def test_router_benchmark_shows_stock_off_and_the_step_balance_exact(capsys):
    result = router.main(["--steps", "2", "--rounds", "1", "--batch", "4"])
    stock_off = result["stock"][1]
    assert stock_off > 0.1  # stock adds up the 2 micro-batches' router terms
    assert abs(result["hf_parallel (step: first pass)"][1]) < 1e-5
    assert abs(result["hf_parallel (micro_batch)"][1]) < stock_off
    assert "hf_parallel (step: first pass)" in capsys.readouterr().out


class FakePeaks:
    """torch.cuda's peak memory statistics of device 0, for the benchmark's window on a machine without GPUs."""

    def __init__(self, monkeypatch):
        self.peak, self.resets = 0, []
        monkeypatch.setattr(torch.cuda, "synchronize", lambda device: None)
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: self.peak)
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", self.reset)

    def reset(self, device):
        self.resets.append(device)
        self.peak = 0


def _run(steady: gpu_steps.SteadyState, fake: FakePeaks, peaks: list[int], settled_after: int | None) -> None:
    """Steps 1..len(peaks), each reaching its peak; the check settles at the end of step `settled_after`."""
    state = TrainerState(max_steps=len(peaks))
    for step, peak in enumerate(peaks, 1):
        state.global_step = step
        steady.on_step_begin(None, state, None)
        fake.peak = max(fake.peak, peak)
        if steady.exact is not None:
            steady.exact.checks_settled = settled_after is not None and step >= settled_after
        steady.on_step_end(None, state, None)


def test_steady_state_peak_excludes_the_warmup_and_the_check(monkeypatch):
    fake = FakePeaks(monkeypatch)
    # hf_parallel, its check undecided at step 1 (30 GiB: the labels kept in the forward), settled at step 2.
    steady = gpu_steps.SteadyState(warmup=1, devices=[0])
    steady.exact = SimpleNamespace(checks_settled=False)
    _run(steady, fake, [30, 29, 12, 12, 11], settled_after=2)
    assert (steady.since, steady.check_settled, fake.resets) == (2, True, [0, 0])
    assert fake.peak == 12 and steady.warmup_peaks == [30]  # steps 3-5 only
    assert sorted(steady.step_times) == [1, 2, 3, 4, 5] and len(steady.times) == 3
    # Never settled: reset until the step before the last, and said so.
    fake = FakePeaks(monkeypatch)
    steady = gpu_steps.SteadyState(warmup=1, devices=[0])
    steady.exact = SimpleNamespace(checks_settled=False)
    _run(steady, fake, [30, 30, 30, 30], settled_after=None)
    assert (steady.since, steady.check_settled, fake.resets) == (3, False, [0, 0, 0]) and fake.peak == 30
    # Stock (no check): one reset, at the end of the warm-up.
    fake = FakePeaks(monkeypatch)
    steady = gpu_steps.SteadyState(warmup=2, devices=[0])
    _run(steady, fake, [20, 12, 12, 12], settled_after=None)
    assert (steady.since, steady.check_settled, fake.resets, fake.peak) == (2, None, [0], 12)


def test_balance_gpu_says_which_steps_the_peak_covers(capsys):
    args = argparse.Namespace(warmup=1, steps=3, search=False, dry_run=0)
    bench = gpu_steps.Bench(args, device_ids=[0, 1], device=torch.device("cpu"))
    gib = gpu_steps.GIB

    def result(label, stock, settled, peaks, gpu0_bsz=None):
        return gpu_steps.Result(
            gpu_steps.Config(label, stock, gpu0_bsz), [4, 4], "DataParallel", samples_per_s=10.0, train_loss=1.0,
            peaks=peaks, warmup_peaks=[40 * gib, 20 * gib], since=1, check_settled=settled,
        )  # fmt: skip

    results = [
        result("stock", True, None, [20 * gib, 18 * gib]),
        result("exact", False, False, [30 * gib, 20 * gib]),
        result("gpu0_bsz=0", False, True, [10 * gib, 25 * gib], gpu0_bsz=0),
    ]
    balance_gpu.print_table(results, bench)
    printed = capsys.readouterr().out
    assert "steps measured" in printed and "2-4, check settled" in printed
    assert "2-4, check UNDECIDED (its steps counted)" in printed
    assert "steps 1-1: 40.00, 20.00" in printed  # the warm-up's own peak, printed apart
    lines = balance_gpu.assess(results, bench)
    assert lines[0].endswith(
        "MISS (hf_parallel's check of its loss head was still undecided: its steps are in its peak)"
    )
    assert lines[1].endswith("gpu0_bsz=0: 50% below: PASS")


def test_detection_benchmark_shows_stock_off_and_hf_parallel_exact(capsys):
    pytest.importorskip("scipy")
    rows = detection.measure(ddp=False)
    sides = {(name, side): (loss, eval_loss, grad) for name, topology, side, loss, eval_loss, grad in rows}
    assert {topology for _, topology, *_ in rows} == {"GA 2"}
    for name in ("detr_detection", "deformable_detr_detection", "yolos_detection"):
        assert sides[name, "stock"][2] > 0.01  # a mean of micro-batch means: images weigh by their micro-batch
        loss, eval_loss, grad = sides[name, "hf_parallel"]
        assert abs(loss - 1) < 1e-5 and abs(eval_loss - 1) < 1e-5 and grad < 1e-5
    detection.print_table(rows)
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("|")]
    assert printed[0].startswith("| model | topology | trainer |") and len(printed) == 2 + len(rows)
