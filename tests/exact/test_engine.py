"""The engines, declared once (`hf_parallel.exact.engine`): what each counts, scales and logs, and which is picked."""

from __future__ import annotations

import pytest
import torch

from hf_parallel.exact import CrossEntropyHead, Engine, ExactLoss, count_step, pick_engine


def _sum(tensor: torch.Tensor) -> torch.Tensor:
    return tensor * 2  # two ranks holding the same counts


def test_one_process_and_data_parallel_count_alone_and_scale_nothing():
    for engine, replicas in ((pick_engine(1), False), (pick_engine(1, data_parallel=True), True)):
        assert (engine.count_ranks, engine.gradient_factor, engine.log_ranks) == (1, 1, 1)
        assert engine.replicas is replicas and not engine.pads_epoch_end and not engine.shards_sequence
    assert pick_engine(1).name == "one process" and pick_engine(1, data_parallel=True).name == "DataParallel replicas"


def test_ddp_fsdp_and_zero_add_every_rank_and_undo_the_average():
    for engine, name in (
        (pick_engine(4, reduce_sum=_sum), "DDP"),
        (pick_engine(4, reduce_sum=_sum, name="FSDP"), "FSDP"),
        (pick_engine(4, reduce_sum=_sum, deepspeed_stage=2), "DeepSpeed ZeRO-2"),
    ):
        assert engine.name == name
        assert (engine.count_ranks, engine.gradient_factor, engine.log_ranks) == (4, 4, 4)
        assert engine.pads_epoch_end and engine.reduce_sum is _sum
        loss = torch.tensor(0.25, requires_grad=True)
        assert engine.as_logged(loss) is loss  # logged as it is back-propagated


@pytest.mark.parametrize(
    ("stage", "version", "factor"),
    [(2, (0, 19, 8), 2), (3, (0, 19, 8), 4), (3, (0, 20, 2), 2), (1, None, 2)],
)
def test_ulysses_scales_by_its_data_parallel_ranks_and_logs_the_whole(stage, version, factor):
    """
    4 ranks, sequence parallel x2: ZeRO adds the SP ranks' parts and averages the 2 data-parallel ranks (ZeRO-3
    before deepspeed 0.20.2 averages all 4); each rank's share is logged as a DDP rank's.
    """
    engine = pick_engine(4, reduce_sum=_sum, deepspeed_stage=stage, sequence_parallel=2, deepspeed_version=version)
    assert (engine.count_ranks, engine.gradient_factor, engine.log_ranks) == (4, factor, 4)
    assert engine.shards_sequence and not engine.pads_epoch_end
    loss = torch.tensor(0.5, requires_grad=True)
    valued = engine.as_logged(loss)
    assert valued.item() == pytest.approx(0.5 * 4 / factor)
    valued.backward()
    assert loss.grad.item() == 1.0  # the gradient of the share, unchanged


def test_several_processes_need_a_way_to_add_their_counts():
    with pytest.raises(ValueError, match="over 2 processes needs reduce_sum"):
        pick_engine(2)


def test_exact_loss_counts_a_step_with_its_engine():
    exact = ExactLoss(num_processes=2, reduce_sum=_sum)
    assert isinstance(exact.engine, Engine) and exact.engine.gradient_factor == 2
    exact.engine = pick_engine(4, reduce_sum=_sum, deepspeed_stage=1, sequence_parallel=2)
    step = count_step(exact, CrossEntropyHead(), [{"labels": torch.tensor([[1, 2, -100]])}])
    assert step.scale == 2 and step.counts.tolist() == [4]  # 2 items here, as many on the other rank


# ---- The engine owns its process group: a contrastive loss over a group smaller than the world ----


def _contrastive_in_a_group(output_dir: str) -> None:
    """Rank r of 4, in group r // 2 of 2 ranks: an ExactLoop over that group, a CLIP step on its share of the group's
    8 rows (each group its own rows), the logged loss and the gradient DDP averaged over the group."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from hf_parallel import ExactLoop
    from tests.helpers.contrastive import CASES, collate

    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == 4
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank makes every group, in the same order
    group = groups[rank // 2]
    case = CASES["clip_contrastive"]
    rows = case.rows(8, rank // 2)[(rank % 2) * 4 : (rank % 2 + 1) * 4]
    model = DistributedDataParallel(case.build(0), process_group=group)
    loop = ExactLoop(process_group=group)
    loader = torch.utils.data.DataLoader(rows, batch_size=4, collate_fn=collate)
    for step in loop.steps(loader, accumulation_steps=1):
        for batch in step:
            step.loss(model, batch).backward()
        logged = step.logged_loss()
    grads = {name: p.grad.clone() for name, p in model.module.named_parameters() if p.grad is not None}
    torch.save({"logged": logged, "grads": grads}, f"{output_dir}/rank{rank}.pt")
    dist.barrier()


@pytest.mark.full  # 4 spawned ranks (~20 s): .ci/run runs it in its own step
def test_a_contrastive_loss_over_a_process_group_smaller_than_the_world_is_the_group_s(tmp_path):
    from hf_parallel.testing import spawn_cpu_ranks
    from tests.helpers.contrastive import CASES, collate
    from tests.helpers.harness import max_relative_diff

    spawn_cpu_ranks(_contrastive_in_a_group, (str(tmp_path),), num_processes=4, timeout=240)
    case = CASES["clip_contrastive"]
    for group in (0, 1):
        model = case.build(0)
        loss = model(**collate(case.rows(8, group))).loss  # one process on the group's 8 rows
        loss.backward()
        expected = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
        for rank in (2 * group, 2 * group + 1):
            result = torch.load(tmp_path / f"rank{rank}.pt")
            assert result["logged"] == pytest.approx(loss.item(), rel=1e-5), (group, rank)
            assert max_relative_diff(result["grads"], expected) < 1e-5, (group, rank)
