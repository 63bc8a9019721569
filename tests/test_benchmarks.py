"""
The benchmarks print figures, not verdicts; here one fast case of `benchmarks/reach.py` (the in-process part of
case 1, LoRA under gradient accumulation) is run for its figures: stock visibly off, hf_parallel on the reference.
"""

from __future__ import annotations

import pytest

from benchmarks import reach


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
