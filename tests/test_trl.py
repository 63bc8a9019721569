"""
TRL's SFTTrainer through `TrainerMixin` (first in the bases) and through `hf_parallel.Trainer` (combined): its
config class, its own loss and its own logs stay, next to the stock SFTTrainer's run.
"""

from __future__ import annotations

import pytest
import torch
import transformers

import hf_parallel
from hf_parallel import TrainerMixin
from tests.helpers.heads import CASES, lm_rows
from tests.helpers.trl_runs import CASES as TRL_CASES
from tests.helpers.trl_runs import run_one_step

# TRL (a test extra) and datasets are absent from some GPU images, where `benchmarks.gpu_check` collects every test
# module: without them this module skips instead of failing the whole collection (pytest's exit 2).
datasets = pytest.importorskip("datasets")
trl = pytest.importorskip("trl")
SFTConfig, SFTTrainer = trl.SFTConfig, trl.SFTTrainer
#: The trainers whose own loss hf_parallel makes exact (hf_parallel.exact.heads.trainers).
EXACT_TRAINERS = ("SFTTrainer", "DPOTrainer", "RewardTrainer", "KTOTrainer", "GRPOTrainer", "RLOOTrainer")


class ParallelSFTTrainer(TrainerMixin, SFTTrainer):
    pass


class CombinedSFTTrainer(hf_parallel.Trainer, SFTTrainer):
    pass


def _sft_run(trainer_cls, output_dir) -> transformers.Trainer:
    from examples.train import word_tokenizer

    rows = lm_rows(8, 1)
    texts = datasets.Dataset.from_list(
        [{"input_ids": r["input_ids"][r["attention_mask"].bool()].tolist()} for r in rows]
    )
    args = SFTConfig(
        output_dir=str(output_dir), max_steps=2, per_device_train_batch_size=4, report_to=[], use_cpu=True,
        loss_type="dft", logging_steps=1, save_strategy="no", disable_tqdm=True, seed=0,
    )  # fmt: skip
    trainer = trainer_cls(
        model=CASES["llama_causal_lm"].build(0), args=args, train_dataset=texts, processing_class=word_tokenizer()
    )
    trainer.train()
    return trainer


@pytest.mark.parametrize("trainer_cls", [ParallelSFTTrainer, CombinedSFTTrainer])
def test_trl_keeps_its_config_and_its_own_loss(trainer_cls, tmp_path, hf_parallel_log):
    stock = _sft_run(SFTTrainer, tmp_path / "stock")
    ours = _sft_run(trainer_cls, tmp_path / "ours")
    # Its config class stays (TRL rebuilds it from to_dict(), which must not carry our fields), with our settings.
    assert type(ours.args) is SFTConfig and "exact_loss" not in ours.args.to_dict()
    assert ours.args.exact_loss is True
    # TRL's own loss (loss_type="dft", its fused LM head) made exact over the step, and its own logs: one process and
    # one micro-batch a step give stock's steps.
    losses = [log["loss"] for log in ours.state.log_history if "loss" in log]
    assert losses == pytest.approx([log["loss"] for log in stock.state.log_history if "loss" in log], rel=1e-6)
    assert "entropy" in ours.state.log_history[0]
    assert not any("overrides compute_loss" in m for m in hf_parallel_log.messages), hf_parallel_log.messages


# ---- Every trainer TRL exports, with the mixin first (tests/helpers/trl_runs.py builds them) ----


def _parallel(name: str) -> type:
    """`class ParallelXTrainer(TrainerMixin, trl.XTrainer): pass`, as docs/how-to/trainer-subclasses.md says."""
    return type(f"Parallel{name}", (TrainerMixin, getattr(trl, name)), {})


def _first_step(trainer) -> dict:
    """The first step's logged values, less its wall time."""
    return {key: value for key, value in trainer.state.log_history[0].items() if key != "step_time"}


def test_every_trainer_trl_exports_is_covered():
    exported = {
        name
        for name in dir(trl)
        if isinstance(getattr(trl, name), type) and issubclass(getattr(trl, name), transformers.Trainer)
    }
    assert exported <= TRL_CASES.keys(), f"TRL exports trainers the test does not build: {exported - TRL_CASES.keys()}"


@pytest.mark.parametrize("positional", [False, True], ids=["keywords", "positional"])
@pytest.mark.parametrize("name", sorted(TRL_CASES))
def test_every_trl_trainer_runs_its_first_step_as_stock(name, positional, tmp_path, hf_parallel_log):
    case = TRL_CASES[name]
    stock = run_one_step(trl, case, getattr(trl, name), str(tmp_path / "stock"))
    ours = run_one_step(trl, case, _parallel(name), str(tmp_path / "ours"), positional=positional)
    assert type(ours.args) is getattr(trl, case.config) and ours.args.exact_loss is True
    warned = any(f"{name} overrides compute_loss" in m for m in hf_parallel_log.messages)
    pairs = zip(ours.model.state_dict().items(), stock.model.state_dict().values(), strict=True)
    if name in EXACT_TRAINERS:
        # Its own loss made exact over the step (tests/test_trl_exact.py): one micro-batch on one process is stock's
        # step, to float rounding (S / C of the step is the micro-batch's mean again).
        assert not warned, hf_parallel_log.messages
        assert _first_step(ours) == pytest.approx(_first_step(stock), rel=1e-6)
        for (key, mine), theirs in pairs:
            torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=1e-7, msg=key)
    else:
        # Its own loss stays (said once, with why), and one process gives stock's step to the bit.
        assert warned, hf_parallel_log.messages
        assert _first_step(ours) == _first_step(stock)
        for (key, mine), theirs in pairs:
            assert torch.equal(mine, theirs), key
    # The step moved the weights: a run that trained nothing would pass the comparisons above.
    assert not all(
        torch.equal(trained, initial)
        for trained, initial in zip(ours.model.state_dict().values(), case.model(0).state_dict().values(), strict=True)
    ), "the step left every weight where it started"


class _PassThrough(TrainerMixin, trl.DPOTrainer):
    """A user subclass with its own `__init__` that hands everything on."""

    def __init__(self, *args, note: str = "", **kwargs):
        self.note = note
        super().__init__(*args, **kwargs)


def test_a_pass_through_init_between_keeps_the_trainer_s_order(tmp_path):
    case = TRL_CASES["DPOTrainer"]
    trainer = run_one_step(trl, case, _PassThrough, str(tmp_path), positional=True)
    assert isinstance(trainer.ref_model, torch.nn.Module) and trainer.args.exact_loss is True


def test_arguments_the_trainer_does_not_take_are_named(tmp_path):
    with pytest.raises(TypeError, match=r"ParallelDPOTrainer\(\.\.\.\): .*unknown_option"):
        _parallel("DPOTrainer")(model=TRL_CASES["DPOTrainer"].model(0), unknown_option=1)
