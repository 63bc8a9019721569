"""TrainingArguments: the new fields parse from the command line, round-trip through JSON and validate by name; stock
arguments are upgraded."""

import json

import pytest
import transformers
from transformers import HfArgumentParser

from hf_parallel import Trainer, TrainingArguments
from tests.helpers.tiny import classification_rows, tiny_bert_classifier


def test_stock_arguments_are_upgraded(tmp_path):
    stock = transformers.TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, report_to="none", learning_rate=3e-4
    )
    trainer = Trainer(model=tiny_bert_classifier(), args=stock, train_dataset=classification_rows(4))
    assert isinstance(trainer.args, TrainingArguments)
    assert trainer.args.learning_rate == 3e-4
    assert trainer.args.exact_loss is True
    assert trainer.args.gpu0_bsz is None


def test_new_fields_parse_from_the_command_line(tmp_path):
    parser = HfArgumentParser(TrainingArguments)
    (args,) = parser.parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--gpu0_bsz", "3", "--exact_loss", "False", "--use_cpu", "True"]
    )
    assert args.gpu0_bsz == 3
    assert args.exact_loss is False
    assert args.gpu0_weight is None
    (args,) = parser.parse_args_into_dataclasses(["--output_dir", str(tmp_path), "--gpu0_weight", "0.5"])
    assert args.gpu0_weight == 0.5
    assert args.exact_loss is True


def test_help_lists_the_new_fields():
    text = HfArgumentParser(TrainingArguments).format_help()
    for flag in ("--gpu0_bsz", "--gpu0_weight", "--exact_loss"):
        assert flag in text


def test_to_dict_and_json_round_trip(tmp_path):
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, gpu0_bsz=2, exact_loss=False)
    as_dict = json.loads(args.to_json_string())
    assert as_dict["gpu0_bsz"] == 2
    assert as_dict["exact_loss"] is False
    assert as_dict["gpu0_weight"] is None


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"gpu0_bsz": -1}, "gpu0_bsz must be a whole number >= 0, got -1."),
        ({"gpu0_bsz": 5}, "gpu0_bsz=5 is above GPU 0's even share"),
        ({"gpu0_bsz": 2.5}, "gpu0_bsz must be a whole number >= 0, got 2.5."),
        ({"gpu0_bsz": 1, "gpu0_weight": 0.5}, "Set at most one of gpu0_bsz (1) and gpu0_weight (0.5)"),
        ({"gpu0_weight": float("nan")}, "gpu0_weight must be a finite number in [0, 1]"),
        ({"gpu0_weight": float("inf")}, "got inf"),
        ({"gpu0_weight": -0.1}, "got -0.1"),
        ({"gpu0_weight": 1.5}, "got 1.5"),
        ({"gpu0_weight": 2.0}, "gpu0_weight must be a finite number in [0, 1]"),
        ({"exact_loss": "yes"}, "exact_loss must be True or False"),
    ],
)
def test_bad_values_are_rejected_by_name(tmp_path, kwargs, message):
    with pytest.raises(ValueError) as excinfo:
        TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, use_cpu=True, **kwargs)
    assert message in str(excinfo.value)
