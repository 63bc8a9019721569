"""
The benchmarks print figures, not verdicts; here `benchmarks/fused_memory.py` runs at its `--quick` sizes in this
process (one step per run; its CPU peaks are then not the fresh-process figures, so only their presence is checked),
for the stand-in's record: stock's Trainer hands the fused model its labels and the full logits are never built; the
plain control always builds them. Then the printed table and the command line's checks.
"""

from __future__ import annotations

import dataclasses

import pytest

from benchmarks import fused_memory


def test_quick_sizes_run_both_trainers_and_the_table_shows_the_logits_record():
    sizes = dataclasses.replace(fused_memory.QUICK, seq=16, vocab=1024)
    results = fused_memory.measure(sizes, rounds=1, steps=1, fresh=False)
    assert set(results) == {"fused", "plain", "moe"}
    for workload, result in results.items():
        assert result["errors"] == {}, workload
        assert set(result["peak_mib"]) == {"stock", "hf_parallel"}, workload
        assert all(peak >= 0 for peak in result["peak_mib"].values()), workload
        assert all(seconds > 0 for seconds in result["seconds"].values()), workload
    fused = results["fused"]["forwards"]
    # One optimizer step of gradient accumulation 2: stock runs the fused path in both micro-batches.
    assert fused["stock"] == {"fused": sizes.grad_accum, "logits": 0}
    assert sum(fused["hf_parallel"].values()) >= sizes.grad_accum
    assert results["plain"]["forwards"] == {"stock": None, "hf_parallel": None}
    assert results["moe"]["forwards"] == {"stock": None, "hf_parallel": None}

    lines = fused_memory.table(results)
    cells = [[cell.strip() for cell in line.split("|")] for line in lines]
    header = ["workload", "stock MiB", "hf_parallel MiB", "ratio", "time ratio", "full logits built: stock"]
    assert cells[0] == [*header, "hf_parallel"]
    assert [row[0] for row in cells[1:]] == ["fused", "plain", "moe"]
    assert float(cells[1][4]) > 0  # hf_parallel's seconds over stock's
    assert cells[1][5] == "no (0 of 2 forwards)"
    assert cells[2][5:] == ["always", "always"]
    assert cells[3][5:] == ["always", "always"]


def test_a_failed_side_is_shown_in_the_table_not_as_a_figure():
    results = {
        "fused": {
            "peak_mib": {"stock": 300.0, "hf_parallel": None},
            "seconds": {"stock": 12.0, "hf_parallel": None},
            "forwards": {"stock": {"fused": 6, "logits": 0}, "hf_parallel": None},
            "errors": {"hf_parallel": "KeyError: 'logits'"},
        }
    }
    cells = [cell.strip() for cell in fused_memory.table(results)[1].split("|")]
    assert cells == ["fused", "300.0", "failed", "-", "-", "no (0 of 6 forwards)", "failed: KeyError: 'logits'"]


def test_options_quick_defaults_and_liger_needs_liger_kernel(capsys):
    options = fused_memory._parse(["--quick"])
    assert (options.rounds, options.steps, options.sizes) == (1, 1, fused_memory.QUICK)
    assert options.workloads == ["fused", "plain", "moe"]
    assert fused_memory._parse(["--workloads", "moe"]).workloads == ["moe"]
    options = fused_memory._parse(["--rounds", "2", "--steps", "4", "--chunk-size", "8"])
    assert (options.rounds, options.steps, options.sizes.chunk, options.sizes.vocab) == (2, 4, 8, 128256)
    with pytest.raises(SystemExit):
        fused_memory._parse(["--rounds", "0"])
    assert "--rounds" in capsys.readouterr().err
    try:
        import liger_kernel  # noqa: F401
    except ImportError:
        with pytest.raises(SystemExit):
            fused_memory._parse(["--liger"])
        assert "--liger needs liger-kernel" in capsys.readouterr().err
    else:
        assert fused_memory._parse(["--liger"]).liger
