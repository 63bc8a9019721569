"""
The check that lets the model judge its own loss (`hf_parallel.exact.check`, `hf_parallel.exact.compare`), at the
sizes users train at.

Its forward gives the model an item count no batch has, and tells from the loss whether the model divided by
it. A loss that ignores the count (BART's and T5's plain `CrossEntropyLoss` mean) must be told apart from one that
honours it (Llama's `ForCausalLMLoss`) however many items a micro-batch holds: summarisation and speech fine-tuning
train on thousands of target tokens per micro-batch, where a count off by 1/2 hides below any float tolerance.

The reference is the model's own loss and gradient on the whole optimizer step in one forward; the stock Trainer is
the control that must differ.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import (
    BartConfig,
    BartForConditionalGeneration,
    LlamaConfig,
    LlamaForCausalLM,
    T5Config,
    T5ForConditionalGeneration,
    default_data_collator,
)

from hf_parallel.exact import CrossEntropyHead, Route
from hf_parallel.exact.check import Verdict, Votes, decide
from hf_parallel.exact.compare import ReplicaCheck, probe_count, replica_check
from tests.helpers.harness import Topology, max_relative_diff, run_case
from tests.helpers.heads import Case
from tests.helpers.tiny import tiny

VOCAB = 64
# Long targets: GA 2 x 2 rows x up to 3,000 tokens, about 11,000 items per step and over 5,000 per micro-batch, where
# a count off by 1/2 changed a float32 loss by less than 1e-4.
TARGET = 3000
ROWS = 4
GA2 = Topology("GA 2 x 2 rows", per_device=ROWS // 2, accumulation=2)
DP2 = Topology("DP 2 x 2 rows", per_device=ROWS, dp_devices=2)

# A micro-batch's items (1 to 10 million), its mean loss per item, and the dtype the model computes its loss in.
ITEMS = st.integers(min_value=1, max_value=10**7)
MEANS = st.floats(min_value=1e-3, max_value=20.0)
LOSS_DTYPES = st.sampled_from([torch.float32, torch.float16, torch.bfloat16])


def _honours(items: int, mean: float, dtype: torch.dtype, divides_by_count: bool, logits: bool) -> float:
    """
    What the check says of a model loss of `items` items and mean `mean` (rounded to `dtype`), given the probe's
    count: with logits by comparing it with the sums, without (a fused loss) by its loss given twice the count.
    """
    head = CrossEntropyHead(name="causal_lm", shift=True, per_position=True)
    sums, counts = torch.tensor([[mean * items]], dtype=torch.float64), torch.tensor([[items]])
    count = probe_count(counts.sum())

    def given(n: torch.Tensor) -> torch.Tensor:  # the model's loss given the count n
        return ((sums.sum() / n) if divides_by_count else sums.sum() / items).to(dtype)

    outputs, doubled = {"loss": given(count)}, None
    if logits:
        outputs["logits"] = torch.zeros(1, 1, 1)  # not read: the candidate's sums are given
    else:
        doubled = given(count * 2)
    check = replica_check((head,), outputs, lambda h: (sums.float(), counts), count=count, doubled=doubled)
    return float(check.honours)


@settings(max_examples=300, deadline=None)
@given(items=ITEMS, mean=MEANS, dtype=LOSS_DTYPES, logits=st.booleans())
def test_check_tells_a_divided_loss_from_a_mean_at_every_size(items, mean, dtype, logits):
    """A loss divided by the count it is given, and one that keeps its own mean, rounded to the loss's precision."""
    assert _honours(items, mean, dtype, divides_by_count=True, logits=logits) == 1.0
    assert _honours(items, mean, dtype, divides_by_count=False, logits=logits) == 0.0


def test_probe_count_is_no_count_of_items():
    counts = torch.arange(0, 100_000)
    probes = probe_count(counts)
    assert probes.dtype == torch.float32
    assert bool((probes != probes.round()).all())  # never a whole number: no micro-batch's count
    assert bool((probes[1:] / counts[1:] >= 2).all())  # S / N at most half of S / C: far beyond any tolerance


def _t5(seed: int, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = tiny(T5Config, vocab_size=VOCAB, decoder_start_token_id=0, pad_token_id=0)
    return T5ForConditionalGeneration(config).to(dtype)


def _bart(seed: int, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = tiny(BartConfig, vocab_size=VOCAB, max_position_embeddings=TARGET + 8)
    return BartForConditionalGeneration(config).to(dtype)


def _llama(seed: int, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(seed)
    return LlamaForCausalLM(tiny(LlamaConfig, vocab_size=VOCAB, max_position_embeddings=TARGET + 8)).to(dtype)


def long_seq2seq_rows(n: int, seed: int, target: int = TARGET) -> list[dict]:
    """Short sources, long uneven targets (target / 4 to `target` tokens, -100 after), as in summarisation."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        length = int(torch.randint(target // 4, target + 1, (1,), generator=g)) if i else target
        labels = torch.randint(3, VOCAB, (target,), generator=g)
        labels[length:] = -100
        rows.append({"input_ids": torch.randint(3, VOCAB, (16,), generator=g), "labels": labels})
    return rows


def long_lm_rows(n: int, seed: int, target: int = TARGET) -> list[dict]:
    """Long uneven rows of a causal LM, padded with -100 labels."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        length = int(torch.randint(target // 4, target + 1, (1,), generator=g)) if i else target
        ids = torch.randint(3, VOCAB, (target,), generator=g)
        mask = (torch.arange(target) < length).long()
        rows.append({"input_ids": ids * mask, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)})
    return rows


def _reference(case: Case, rows: int, dtype: torch.dtype) -> tuple[float, dict, int]:
    """The model's own loss and gradient on the whole step in one forward, and the step's item count."""
    model = case.build(0, dtype)
    batch = default_data_collator(case.rows(rows, 1))
    loss = model(**batch).loss
    loss.backward()
    grads = {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}
    return loss.item(), grads, int((batch["labels"] != -100).sum())


def _case(name: str, build, rows, dtype: torch.dtype) -> Case:
    return Case(name, lambda seed: build(seed, dtype), rows)


REAL_SIZE_CASES = {
    "t5": (_t5, long_seq2seq_rows),
    "bart": (_bart, long_seq2seq_rows),
    "llama": (_llama, long_lm_rows),  # the control: its loss honours the count
}


# T5 under DataParallel (16 s) is a rarer row, behind `full`: BART covers a plain-mean loss there, T5 under GA.
@pytest.mark.parametrize(
    ("name", "topology"),
    [
        pytest.param(
            name, topology, id=f"{name}-{label}", marks=[pytest.mark.full] if (name, label) == ("t5", "DP2") else []
        )
        for name in sorted(REAL_SIZE_CASES)
        for topology, label in ((GA2, "GA2"), (DP2, "DP2"))
    ],
)
def test_real_size_step_is_exact_whether_the_loss_honours_the_count(name, topology):
    """Over 8,000 items per step, in gradient accumulation and in emulated DataParallel (each replica checks)."""
    build, rows = REAL_SIZE_CASES[name]
    case = Case(name, build, rows)
    loss, grads, items = _reference(case, ROWS, torch.float32)
    assert items > 8000  # the size the check must hold at
    result = run_case(_case(name, build, rows, torch.float32), topology, train_rows=ROWS, eval_rows=0)
    honours = result.trainer.exact.head(result.trainer.model).route is Route.MODEL_LOSS
    assert honours == (name == "llama")
    assert result.loss == pytest.approx(loss, rel=1e-5)
    assert max_relative_diff(result.grads, grads) < 1e-4
    if name != "llama":  # stock is exact where the loss honours the count; the control must differ elsewhere
        stock = run_case(_case(name, build, rows, torch.float32), topology, stock=True, train_rows=ROWS, eval_rows=0)
        # GA: a sum of micro-batch means (not divided by GA); DP: each replica's mean, summed (x n_gpu).
        assert stock.loss / loss == pytest.approx(2.0, rel=0.2)


@pytest.mark.parametrize("name", ["bart", "llama"])
def test_half_precision_loss_is_judged_at_hundreds_of_items(name):
    """
    A float16 model: BART's loss is computed and rounded in float16 (compared within 1e-2, where a count off by 1/2
    hid from C = 50 on); Llama's upcasts its logits to float32.
    """
    build, rows = REAL_SIZE_CASES[name]
    short = Case(name, build, lambda n, seed: rows(n, seed, target=200))
    loss, grads, items = _reference(short, ROWS, torch.float16)
    assert items > 400
    result = run_case(_case(name, build, short.rows, torch.float16), GA2, train_rows=ROWS, eval_rows=0)
    honours = result.trainer.exact.head(result.trainer.model).route is Route.MODEL_LOSS
    assert honours == (name == "llama")
    # float16 rounding of the loss and of the gradient's accumulation: about 1e-3; a count taken as honoured while
    # the loss ignores it, or the stock loss, is x2.
    assert result.loss == pytest.approx(loss, rel=5e-3)
    assert max_relative_diff({k: v.float() for k, v in result.grads.items()}, grads) < 1e-2
    if name != "llama":
        stock = run_case(_case(name, build, short.rows, torch.float16), GA2, stock=True, train_rows=ROWS, eval_rows=0)
        assert stock.loss / loss == pytest.approx(2.0, rel=0.2)


class SavedLogits(transformers.TrainerCallback):
    """
    How many logits-sized tensors (`[..., vocabulary]`, at least `min_numel` entries: not the LM head's weight) each
    optimizer step's forwards keep for the backward (autograd's saved-tensor hooks, deduplicated by storage): one per
    micro-batch for the model's own cross-entropy (its log-softmax).
    """

    def __init__(self, vocab: int, min_numel: int):
        self.vocab, self.min_numel, self.per_step, self._seen = vocab, min_numel, [], {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda packed: packed)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.dim() > 0 and tensor.shape[-1] == self.vocab and tensor.numel() >= self.min_numel:
            # Kept until the step ends, so that no later buffer can reuse the address of one counted already.
            storage = tensor.untyped_storage()
            self._seen[storage.data_ptr()] = storage
        return tensor

    def on_train_begin(self, args, state, control, **kwargs):
        self._hooks.__enter__()

    def on_step_end(self, args, state, control, **kwargs):
        self.per_step.append(len(self._seen))
        self._seen = {}

    def on_train_end(self, args, state, control, **kwargs):
        self._hooks.__exit__(None, None, None)


@pytest.mark.parametrize("name", ["llama", "t5"])
def test_the_checked_step_keeps_no_more_logits_for_backward_than_stock(name):
    """The check compares the candidate heads without autograd and takes the step's gradient from the model's own
    loss: its forward keeps as many logits-sized buffers for the backward as stock's (it kept three per forward)."""
    build, rows = REAL_SIZE_CASES[name]
    case = Case(name, lambda seed: build(seed, torch.float32), lambda n, seed: rows(n, seed, target=40))
    saved = {}
    for side in ("stock", "hf_parallel"):
        record = SavedLogits(VOCAB, min_numel=40 * VOCAB)  # a row's logits; the LM head's weight is 16 x VOCAB
        run_case(case, GA2, stock=side == "stock", train_rows=2 * ROWS, eval_rows=0, max_steps=2, callbacks=(record,))
        saved[side] = record.per_step
    assert saved["stock"] == [2, 2]  # one log-softmax per micro-batch
    assert saved["hf_parallel"] == saved["stock"]


# ---- The decisions of the check, from the votes of every replica and rank ----------------------------------------

NAN = float("nan")


def replica_checks(*fits: list[float], decoder: list[float] | None = None) -> ReplicaCheck:
    """The gathered checks of replicas whose candidates fit as `fits` (one row per replica; NaN: not compared)."""
    rows = len(fits)
    unknown = torch.full((rows, 1), NAN)
    return ReplicaCheck(
        fits=torch.tensor(fits, dtype=torch.float64),
        losses=torch.ones(rows, 2, dtype=torch.float64),
        honours=unknown,
        decoder=torch.tensor(decoder).reshape(rows, 1) if decoder is not None else unknown,
    )


def votes_of_a_rank(**counts: list[float]) -> Votes:
    """The votes of another rank: zero but for `counts` (e.g. `fit=[0, 1]`)."""
    zeros = Votes.of(replica_checks([NAN, NAN]))._replace(seen=torch.zeros(1), losses=torch.zeros(2))
    return zeros._replace(**{name: torch.tensor(value, dtype=torch.float64) for name, value in counts.items()})


def decided(check: ReplicaCheck, other_rank: Votes | None = None) -> Verdict:
    votes = Votes.of(check)
    if other_rank is not None:  # what the collective adds: the other rank's votes, field by field
        votes = votes.summed(lambda flat: flat + torch.cat(list(other_rank)))
    return decide(votes)


@pytest.mark.parametrize(
    ("fits", "index", "final"),
    [
        ([[1, 0]], 0, True),  # the chosen head fits, the other does not: confirmed
        ([[0, 1], [0, 1]], 1, True),  # the other fits on every replica: switch
        ([[1, 1]], 0, False),  # both fit: keep it, check again
        ([[0, 0]], None, True),  # none fits: the stock loss
        ([[NAN, NAN]], 0, False),  # nothing to compare: keep it, check again
        ([[1, 0], [0, 1]], None, True),  # replicas disagree: no head fits every replica
        ([[NAN, NAN], [0, 1]], 1, True),  # a replica without items does not vote
        ([[1, NAN]], 0, False),  # the other candidate had no items: keep it, check again (not a fused loss)
    ],
)
def test_decide(fits, index, final):
    verdict = decided(replica_checks(*fits))
    assert (verdict.index, verdict.final) == (index, final)


def test_a_candidate_without_items_is_no_fused_loss():
    # A token classifier's first batch with one target: its shifted candidate has none. The probe said the loss
    # ignores the count; that is no reason to fall back while the logits could compare (it fell back before).
    check = replica_checks([1, NAN])._replace(honours=torch.zeros(1, 1))
    assert (decided(check).index, decided(check).final) == (0, False)
    fused = replica_checks([NAN, NAN])._replace(honours=torch.zeros(1, 1))  # no logits: the gradient tells alone
    assert (decided(fused).index, decided(fused).final) == (None, True)


def test_decide_sums_the_votes_of_every_rank():
    # This rank's replica fits the chosen head; another rank's does not, and fits the other.
    other_rank = votes_of_a_rank(fit=[0, 1], miss=[1, 0], compared=[1])
    assert decided(replica_checks([1, 0]), other_rank).index is None  # no head fits on every rank
    verdict = decided(replica_checks([0, 1]), other_rank)
    assert (verdict.index, verdict.final) == (1, True)  # every rank switches


def test_decide_switches_on_other_decoder_inputs_on_any_rank():
    check = replica_checks([1, 0], [1, 0], decoder=[1.0, NAN])
    assert not decided(check).decoder_differs  # the same inputs, or not known: no switch
    verdict = decided(check, votes_of_a_rank(other_decoder=[1]))
    assert verdict.decoder_differs and (verdict.index, verdict.final) == (0, True)


def test_votes_flatten_into_one_collective_and_back():
    votes = Votes.of(replica_checks([1, 0], [NAN, NAN], decoder=[0.0, 1.0]))
    calls = []
    summed = votes.summed(lambda flat: calls.append(flat.shape) or flat * 2)
    assert calls == [(2 + 2 + 1 + 2 + 1 + 1 + 1 + 1,)]  # one tensor for every vote
    assert all(torch.equal(a * 2, b) for a, b in zip(votes, summed, strict=True))
    assert float(votes.other_decoder) == 1 and float(votes.compared) == 1 and votes.fit.tolist() == [1, 0]
