"""
TRL's trainers exact by TRL's own rule, that a step split into micro-batches or over ranks gives what the whole step
in one micro-batch on one process gives (`hf_parallel.exact.heads.trainers`): the logged loss, the update and
`eval_loss`, for SFT, DPO and the reward trainer, from the installed TRL, next to stock TRL on the same split, which
must differ where stock is off. The trainers are built as TRL's docs build them (tests/helpers/trl_runs.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from hf_parallel import TrainerMixin
from hf_parallel.testing import spawn_cpu_ranks
from tests.helpers.epochs import update_error
from tests.helpers.trl_runs import CASES, dataset_rows, moe_lm, tokenizer, train_split

datasets = pytest.importorskip("datasets")
trl = pytest.importorskip("trl")

LOSS, UPDATE = 1e-5, 1e-4
#: TRL's logged metrics that are means over the head's items, minima or maxima (hf_parallel.exact.heads.trainers).
LOGGED = {
    "SFTTrainer": ("entropy", "mean_token_accuracy"),
    "DPOTrainer": ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
                   "logps/rejected"),
    "RewardTrainer": ("accuracy", "margin", "mean_reward", "min_reward", "max_reward"),
}  # fmt: skip

# Each trainer with the settings whose loss is a sum over items: SFT's token losses (`nll`, DFT's weighted ones), DPO's
# per-pair losses (one type, a weighted combination, IPO) and the reward model's Bradley-Terry loss with its centring
# term or a margin column.
SETTINGS = {
    "sft": ("SFTTrainer", {}),
    "sft_dft": ("SFTTrainer", {"loss_type": "dft"}),
    "dpo": ("DPOTrainer", {}),
    "dpo_weighted": ("DPOTrainer", {"loss_type": ["sigmoid", "bco_pair"], "loss_weights": [0.7, 0.3]}),
    "dpo_ipo": ("DPOTrainer", {"loss_type": "ipo"}),
    "dpo_sft": ("DPOTrainer", {"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0, 0.5]}),  # sft: chosen tokens
    "reward_centred": ("RewardTrainer", {"center_rewards_coefficient": 0.1}),
    "reward_margin": ("RewardTrainer", {"margins": True}),
    "sft_moe": ("SFTTrainer", {"moe": True}),  # a Mixtral's router term over the whole step
    "dpo_moe": ("DPOTrainer", {"moe": True}),
    "kto": ("KTOTrainer", {"beta": 1.0}),  # a KL term large enough that a micro-batch's point moves the update
    "kto_weighted": ("KTOTrainer", {"desirable_weight": 1.3, "undesirable_weight": 0.8}),
    "kto_precomputed": ("KTOTrainer", {"precompute_ref_log_probs": True}),
    "kto_apo": ("KTOTrainer", {"loss_type": "apo_zero_unpaired"}),
    "kto_moe": ("KTOTrainer", {"beta": 1.0, "moe": True}),
}


# The default suite runs one setting of each kind; the others run in CI's `full` step (the suite's 8 minutes).
DEFAULT = {"sft", "dpo", "dpo_sft", "reward_centred", "kto", "sft_moe", "grpo_bnpo", "grpo_dapo_late", "rloo"}


def _settings(settings: dict) -> list:
    return [pytest.param(s, marks=[] if s in DEFAULT else [pytest.mark.full]) for s in sorted(settings)]


def _parallel(name: str) -> type:
    return type(f"Parallel{name}", (TrainerMixin, getattr(trl, name)), {})


def _model(name: str, settings: dict):
    return moe_lm if settings.get("moe") else CASES[name].model


def _assert_exact(result: dict, whole: dict, initial: dict, what: str) -> None:
    assert result["losses"] == pytest.approx(whole["losses"], rel=LOSS), what
    if whole["eval_loss"] is not None:
        assert result["eval_loss"] == pytest.approx(whole["eval_loss"], rel=LOSS), what
    assert update_error(result["weights"], whole["weights"], initial) < UPDATE, what


@pytest.mark.parametrize("setting", _settings(SETTINGS))
def test_a_step_split_into_unequal_micro_batches_is_the_whole_step(setting, tmp_path, hf_parallel_log):
    """5 rows a step as micro-batches of 2 + 2 + 1 (evaluation in batches of 2 + 2 + 1) against 5 rows at once."""
    name, settings = SETTINGS[setting]
    initial = _model(name, settings)(0).state_dict()
    run = {"rows": 5, "settings": settings}
    split = {"per_device": 2, "accumulation": 3, "eval_batch": 2, **run}
    whole = train_split(trl, name, getattr(trl, name), str(tmp_path / "whole"), per_device=5, eval_batch=5,
                        kl_pairs=2, **run)  # fmt: skip
    ours = train_split(trl, name, _parallel(name), str(tmp_path / "ours"), **split)
    stock = train_split(trl, name, getattr(trl, name), str(tmp_path / "stock"), **split)
    _assert_exact(ours, whole, initial, setting)
    assert not any("overrides compute_loss" in m for m in hf_parallel_log.messages), hf_parallel_log.messages
    # TRL's logged metrics over the whole step and evaluation set (a weighted mean of its micro-batches' values)
    logged = LOGGED.get(name, ())
    for key in logged:
        assert ours["metrics"][key] == pytest.approx(whole["metrics"][key], rel=LOSS, abs=1e-6), key
        key = f"eval_{key}"
        assert ours["eval_metrics"][key] == pytest.approx(whole["eval_metrics"][key], rel=LOSS, abs=1e-6), key
    if logged:  # stock: a mean of micro-batch means
        assert any(stock["metrics"][key] != pytest.approx(whole["metrics"][key], rel=10 * LOSS) for key in logged)
    if name == "KTOTrainer" and settings.get("loss_type") != "apo_zero_unpaired":
        # The KL reference point TRL logs: the whole step's on every micro-batch, where stock estimates one on each.
        assert ours["metrics"]["kl"] == pytest.approx(whole["metrics"]["kl"], rel=LOSS)
        assert stock["metrics"]["kl"] != pytest.approx(whole["metrics"]["kl"], rel=10 * LOSS)
    # Stock TRL on the same split: a mean of micro-batch means (the pairs' losses, the evaluation's batches).
    if name == "SFTTrainer" and not settings.get("moe"):
        # TRL's SFT divides by the step's tokens; its evaluation still takes a mean of means (and its router term a
        # mean over micro-batches, below)
        assert stock["eval_loss"] != pytest.approx(whole["eval_loss"], rel=10 * LOSS)
    else:
        assert update_error(stock["weights"], whole["weights"], initial) > 0.05


# GRPO and RLOO generate their completions (made fixed by tests/helpers/trl_runs.py: the same rows under every split):
# 8 prompts, two completions each; the first step of 4 completions (or the epoch's 4 steps) as 2 micro-batches of 2,
# with `steps_per_generation` equal to the accumulation steps, smaller or larger; evaluation in batches of 6 + 6 + 4
# completions. The whole step: its 4 completions generated and trained at once, the evaluation's 16 in one batch.
# Stock TRL is off where its loss divides by a count other than the step's (the micro-batch's tokens, the generation
# batch's share), in the update or in eval_loss (a mean of batch means weighted by completions); a mean over
# completions is exact in stock too.
GENERATING_SETTINGS = {
    "grpo": ("GRPOTrainer", {}, None),
    "grpo_bnpo": ("GRPOTrainer", {"loss_type": "bnpo"}, "update"),
    "grpo_dr": ("GRPOTrainer", {"loss_type": "dr_grpo"}, None),
    "grpo_dapo": ("GRPOTrainer", {"loss_type": "dapo"}, "eval_loss"),
    "grpo_dapo_late": ("GRPOTrainer", {"loss_type": "dapo", "steps_per_generation": 4}, "update"),
    # every step of the epoch: each micro-batch generates at its own place in the step
    "grpo_dapo_early": ("GRPOTrainer", {"loss_type": "dapo", "steps_per_generation": 1, "max_steps": -1}, "update"),
    "grpo_sapo": ("GRPOTrainer", {"loss_type": "sapo"}, None),
    "grpo_cispo": ("GRPOTrainer", {"loss_type": "cispo"}, "eval_loss"),
    "grpo_vespo": ("GRPOTrainer", {"loss_type": "vespo"}, "eval_loss"),
    "grpo_luspo": ("GRPOTrainer", {"loss_type": "luspo", "importance_sampling_level": "sequence"}, None),
    "grpo_kl": ("GRPOTrainer", {"loss_type": "bnpo", "beta": 0.5}, "update"),
    "grpo_iterations": ("GRPOTrainer", {"loss_type": "bnpo", "num_iterations": 2}, "update"),
    "rloo": ("RLOOTrainer", {}, None),
}


@pytest.mark.parametrize("setting", _settings(GENERATING_SETTINGS))
def test_a_generating_trainer_s_split_step_is_the_whole_step(setting, tmp_path, hf_parallel_log):
    name, settings, stock_off = GENERATING_SETTINGS[setting]
    initial = _model(name, settings)(0).state_dict()
    run = {"rows": 8, "settings": {"max_steps": 1, "steps_per_generation": 2, **settings}}
    split = {"per_device": 2, "accumulation": 2, "eval_batch": 6, **run}
    whole_settings = {**run["settings"], "steps_per_generation": 1}
    whole = train_split(trl, name, getattr(trl, name), str(tmp_path / "whole"), rows=8, per_device=4, eval_batch=16,
                        settings=whole_settings)  # fmt: skip
    ours = train_split(trl, name, _parallel(name), str(tmp_path / "ours"), **split)
    assert not any("overrides compute_loss" in m for m in hf_parallel_log.messages), hf_parallel_log.messages
    assert ours["losses"] == pytest.approx(whole["losses"], rel=LOSS, abs=1e-7), setting
    assert ours["eval_loss"] == pytest.approx(whole["eval_loss"], rel=LOSS, abs=1e-7), setting
    assert update_error(ours["weights"], whole["weights"], initial) < UPDATE, setting
    if stock_off is not None:
        stock = train_split(trl, name, getattr(trl, name), str(tmp_path / "stock"), **split)
        if stock_off == "update":
            assert update_error(stock["weights"], whole["weights"], initial) > 0.05
        else:
            assert stock["eval_loss"] != pytest.approx(whole["eval_loss"], rel=10 * LOSS)


def test_dpo_s_sft_term_weighted_by_the_pairs_keeps_trl_s_loss(tmp_path):
    """DPO's 'sft' term times the mean of the pairs' weights (`use_weighting`) is no sum over the step's items: TRL's
    loss, with the reason (TRL 1.16 itself stops on it)."""
    from hf_parallel.exact import trainer_loss_head

    args = trl.DPOConfig(
        output_dir=str(tmp_path), loss_type=["sigmoid", "sft"], use_weighting=True, report_to=[], use_cpu=True
    )
    assert "'sft' loss term, a mean over chosen tokens" in trainer_loss_head(trl.DPOTrainer, args, 1)
    args.use_weighting = False
    assert type(trainer_loss_head(trl.DPOTrainer, args, 1)).__name__ == "PairsAndSftHead"


@pytest.mark.parametrize(
    ("settings", "reason"),
    [
        ({"entropy_coef": 0.05}, "entropy bonus"),
        ({"top_entropy_quantile": 0.5}, "entropy mask"),
        ({"moe": True}, "MoE router term"),
    ],
)
def test_a_grpo_term_made_per_micro_batch_keeps_trl_s_loss_and_says_why(settings, reason, tmp_path, hf_parallel_log):
    """GRPO's entropy bonus and mask are taken over each micro-batch's tokens, and a MoE model's router term over its
    completions: TRL's loss, warned naming it."""
    split = {"rows": 8, "per_device": 2, "accumulation": 2, "settings": {"max_steps": 1, **settings}}
    stock = train_split(trl, "GRPOTrainer", trl.GRPOTrainer, str(tmp_path / "stock"), **split)
    ours = train_split(trl, "GRPOTrainer", _parallel("GRPOTrainer"), str(tmp_path / "ours"), **split)
    assert ours["losses"] == stock["losses"]
    assert any(reason in m for m in hf_parallel_log.messages), hf_parallel_log.messages


@pytest.mark.parametrize("name", ["SFTTrainer", "DPOTrainer"])
def test_exact_loss_false_is_stock_trl_to_the_bit(name, tmp_path):
    split = {"rows": 5, "per_device": 2, "accumulation": 3, "eval_batch": 2}
    stock = train_split(trl, name, getattr(trl, name), str(tmp_path / "stock"), **split)
    off = train_split(trl, name, _parallel(name), str(tmp_path / "off"), settings={"exact_loss": False}, **split)
    assert (off["losses"], off["eval_loss"]) == (stock["losses"], stock["eval_loss"])
    for key, value in off["weights"].items():
        assert torch.equal(value, stock["weights"][key]), key


def test_ranks_that_share_batches_keep_the_trainer_s_own_loss(tmp_path, monkeypatch, hf_parallel_log):
    """Context parallelism (ranks holding one batch's pieces): TRL's loss as it is, warned naming it."""
    monkeypatch.setattr(trl.DPOTrainer, "get_cp_size", lambda self: 2)
    trainer = _parallel("DPOTrainer")(
        model=CASES["DPOTrainer"].model(0), ref_model=CASES["DPOTrainer"].model(1),
        args=trl.DPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[], bf16=False),
        train_dataset=datasets.Dataset.from_list(dataset_rows("preference", 4)), processing_class=tokenizer(),
    )  # fmt: skip
    assert trainer._exact_head() is None
    assert any("['context'] parallelism" in m for m in hf_parallel_log.messages), hf_parallel_log.messages


# ---- 2 DDP ranks, steps of 2 x 2 rows ----
# 10 rows: the epoch's last step holds 2 (rank 1's batch all repeated rows); 11 rows: 3 (rank 1's 1 real, 1 repeated).
# Evaluation in batches of 3 a rank: the last batch holds 4 or 5 rows, rank 1's 1 or 2 real, the rest repeated.
# GRPO's bnpo: 10 or 11 prompts (the last dropped by TRL's sampler in training, which deals whole generation batches),
# two completions each, in steps of 2 a rank, each rank's loss a mean over its own tokens in stock; evaluation in
# batches of 2 a rank (11 prompts: the last batch rank 0's 2 real rows, rank 1's 2 repeated).
RANKED = ("sft", "dpo", "dpo_sft", "reward_centred", "reward_margin", "kto", "sft_moe", "dpo_moe", "grpo_bnpo")
ROWS = (10, 11)


def _setting(setting: str) -> tuple[str, dict]:
    return SETTINGS[setting] if setting in SETTINGS else GENERATING_SETTINGS[setting][:2]


def _ranks_worker(out_dir: str) -> None:
    from accelerate.state import AcceleratorState

    torch.set_num_threads(1)  # two ranks on two cores
    results = {}
    for rows in ROWS:
        for setting in RANKED:
            name, settings = _setting(setting)
            for label, cls in (("ours", _parallel(name)), ("stock", getattr(trl, name))):
                out = str(Path(out_dir) / f"{setting}-{rows}-{label}-{dist.get_rank()}")
                # GRPO's evaluation batches hold whole groups (a prompt's completions are made of its group's rows)
                evaluation = 2 if name == "GRPOTrainer" else 3
                results[setting, rows, label] = train_split(
                    trl, name, cls, out, rows=rows, per_device=2, eval_batch=evaluation, settings=settings
                )
                AcceleratorState._reset_state()  # each Trainer builds its own accelerator; the process group stays
    torch.save(results, Path(out_dir) / f"rank{dist.get_rank()}.pt")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> dict:
    out_dir = tmp_path_factory.mktemp("trl_ranks")
    spawn_cpu_ranks(_ranks_worker, args=(str(out_dir),), num_processes=2, timeout=400)
    return torch.load(out_dir / "rank0.pt", weights_only=False)


@pytest.mark.full
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("setting", RANKED)
def test_two_ranks_and_an_uneven_last_step_are_the_whole_steps(setting, rows, ranks, tmp_path):
    name, settings = _setting(setting)
    initial = _model(name, settings)(0).state_dict()
    generating = name == "GRPOTrainer"  # evaluation rows: a prompt's two completions
    whole = train_split(trl, name, getattr(trl, name), str(tmp_path), rows=rows, per_device=4,
                        eval_batch=rows * (2 if generating else 1), settings=settings,
                        kl_pairs=None if generating else 2)  # fmt: skip
    _assert_exact(ranks[setting, rows, "ours"], whole, initial, setting)
    # every step's, the last one's uneven over ranks too; the reward trainer's accuracy and margin are means of the
    # ranks' means in TRL, which no weight of the step can undo where ranks hold unequal pairs
    for key in set(LOGGED.get(name, ())) - {"accuracy", "margin"}:
        mine, theirs = ([log[key] for log in run["logs"]] for run in (ranks[setting, rows, "ours"], whole))
        assert mine == pytest.approx(theirs, rel=LOSS, abs=1e-6), key
    # Stock trains the repeated rows of the last step: its update is off.
    assert update_error(ranks[setting, rows, "stock"]["weights"], whole["weights"], initial) > 0.05


def test_a_router_without_named_experts_keeps_trl_s_router_term(tmp_path, monkeypatch, hf_parallel_log):
    """A MoE config hf_parallel cannot read the experts of: the token loss exact, TRL's router term kept, warned."""
    monkeypatch.setattr("hf_parallel.exact.heads.trainers.router_balance_of", lambda model, asked=False: None)
    split = {"rows": 5, "per_device": 2, "accumulation": 3, "settings": {"moe": True}}
    ours = train_split(trl, "SFTTrainer", _parallel("SFTTrainer"), str(tmp_path / "ours"), **split)
    stock = train_split(trl, "SFTTrainer", trl.SFTTrainer, str(tmp_path / "stock"), **split)
    assert any("router auxiliary term it adds is its own" in m for m in hf_parallel_log.messages)
    # TRL divides SFT's tokens by the step's count already: with its own router term, the step is stock's.
    assert ours["losses"] == pytest.approx(stock["losses"], rel=LOSS)
    assert update_error(ours["weights"], stock["weights"], moe_lm(0).state_dict()) < UPDATE
