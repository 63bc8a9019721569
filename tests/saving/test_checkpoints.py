"""
hf_parallel.saving.checkpoints: the weight files of a checkpoint directory, the keys they store, reading every
format (pickles only with weights_only) and loading into a model, as permissive as the model's own `load_state_dict`
on shapes (torch.ao quantization-aware training) and loud on another architecture's weights.
"""

import json
import os

import pytest
import safetensors.torch
import torch
from torch import nn
from transformers import BertForMaskedLM

from hf_parallel import load_state_dict
from hf_parallel.saving.checkpoints import checkpoint_weight_files, read_state_dict, stored_keys
from tests.helpers.harness import assert_same_weights
from tests.helpers.tiny import TinyRegressor, qat_model, tiny_bert_classifier, tiny_bert_config

# ---- Weight files and their keys ----


def test_checkpoint_weight_files_order_and_shards(tmp_path):
    assert checkpoint_weight_files(tmp_path / "absent") == []
    model = tiny_bert_classifier()
    model.save_pretrained(tmp_path, max_shard_size="4KB")
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    (tmp_path / "notes.safetensors").write_text("not a weight file of the layout")
    index = str(tmp_path / "model.safetensors.index.json")
    assert checkpoint_weight_files(tmp_path) == [index, str(tmp_path / "pytorch_model.bin")]
    assert checkpoint_weight_files(index) == []  # a file is not a checkpoint directory

    shards = sorted(set(json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"].values()))
    assert len(shards) > 1
    os.remove(tmp_path / shards[0])  # a shard already gone is not listed
    listed = checkpoint_weight_files(tmp_path, shards=True)
    assert listed == [index, str(tmp_path / "pytorch_model.bin"), *(str(tmp_path / s) for s in shards[1:])]

    model.save_pretrained(tmp_path / "single")
    assert checkpoint_weight_files(tmp_path / "single") == [str(tmp_path / "single" / "model.safetensors")]


def test_stored_keys_of_every_format(tmp_path):
    prefixed = {"module." + k: v.contiguous() for k, v in tiny_bert_classifier().state_dict().items()}
    safetensors.torch.save_file(prefixed, tmp_path / "w.safetensors")
    torch.save(prefixed, tmp_path / "w.bin")
    index = {"metadata": {}, "weight_map": {k: "w.safetensors" for k in prefixed}}
    (tmp_path / "w.safetensors.index.json").write_text(json.dumps(index))
    for name in ("w.safetensors", "w.bin", "w.safetensors.index.json"):
        assert sorted(stored_keys(tmp_path / name)) == sorted(prefixed), name


@pytest.mark.parametrize("content", ["{}", '{"weight_map": ["a"]}', "not json"])
def test_not_an_index(tmp_path, content):
    path = tmp_path / "model.safetensors.index.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=f"{path} is not a sharded-checkpoint index"):
        stored_keys(path)
    with pytest.raises(ValueError, match=f"{path} is not a sharded-checkpoint index"):
        checkpoint_weight_files(tmp_path, shards=True)
    with pytest.raises(ValueError, match=f"{path} is not a sharded-checkpoint index"):
        read_state_dict(tmp_path)


# ---- Files and directories ----


def _bert_mlm(seed):
    torch.manual_seed(seed)
    return BertForMaskedLM(tiny_bert_config())


def test_load_every_file_format(tmp_path, no_gpus):
    # no_gpus: with one GPU, nn.DataParallel below would move `source` to it, and its weights would not compare.
    source = tiny_bert_classifier(seed=0)
    prefixed = nn.DataParallel(torch.compile(source, backend="eager")).state_dict()
    safetensors.torch.save_file({k: v.contiguous() for k, v in prefixed.items()}, tmp_path / "w.safetensors")
    torch.save(prefixed, tmp_path / "w.bin")
    torch.save(source.state_dict(), tmp_path / "w.pt")
    source.save_pretrained(tmp_path / "dir")
    source.save_pretrained(tmp_path / "sharded", max_shard_size="4KB")
    assert os.path.isfile(tmp_path / "sharded" / "model.safetensors.index.json")
    assert len([f for f in os.listdir(tmp_path / "sharded") if f.endswith(".safetensors")]) > 1
    # A sharded pickle checkpoint in the older layout: pytorch_model.bin.index.json plus shards.
    (tmp_path / "bin_sharded").mkdir()
    keys = list(prefixed)
    halves = {"pytorch_model-00001-of-00002.bin": keys[:10], "pytorch_model-00002-of-00002.bin": keys[10:]}
    for name, part in halves.items():
        torch.save({k: prefixed[k] for k in part}, tmp_path / "bin_sharded" / name)
    index = {"metadata": {}, "weight_map": {k: n for n, part in halves.items() for k in part}}
    (tmp_path / "bin_sharded" / "pytorch_model.bin.index.json").write_text(json.dumps(index))

    for source_path in ["w.safetensors", "w.bin", "w.pt", "dir", "sharded", "bin_sharded"]:
        target = tiny_bert_classifier(seed=1)
        result = load_state_dict(target, tmp_path / source_path)
        assert result == ([], []), source_path
        assert_same_weights(target.state_dict(), source.state_dict(), atol=0)
    target = tiny_bert_classifier(seed=1)
    load_state_dict(target, str(tmp_path / "sharded" / "model.safetensors.index.json"))
    assert_same_weights(target.state_dict(), source.state_dict(), atol=0)


def test_tied_weights_are_not_missing(tmp_path):
    source = _bert_mlm(0)
    source.save_pretrained(tmp_path)
    stored = safetensors.torch.load_file(tmp_path / "model.safetensors")
    assert len(stored) < len(source.state_dict())  # save_pretrained writes tied weights once
    target = _bert_mlm(1)
    assert load_state_dict(target, tmp_path) == ([], [])
    assert_same_weights(target.state_dict(), source.state_dict(), atol=0)
    assert target.cls.predictions.decoder.weight is target.bert.embeddings.word_embeddings.weight


def test_strict_false_reports_and_loads_the_rest():
    source = tiny_bert_classifier(seed=0)
    sd = {k: v for k, v in source.state_dict().items() if not k.startswith("classifier.")}
    sd["extra.weight"] = torch.zeros(1)
    target = tiny_bert_classifier(seed=1)
    result = load_state_dict(target, sd, strict=False)
    assert result.missing_keys == ["classifier.bias", "classifier.weight"]
    assert result.unexpected_keys == ["extra.weight"]
    torch.testing.assert_close(target.bert.pooler.dense.weight, source.bert.pooler.dense.weight)
    assert not torch.equal(target.classifier.weight, source.classifier.weight)


# ---- Errors ----


def test_missing_path(tmp_path):
    missing = tmp_path / "nope" / "model.safetensors"
    with pytest.raises(FileNotFoundError, match=f"No checkpoint at {missing}: the file or directory does not exist"):
        load_state_dict(tiny_bert_classifier(), missing)


def test_directory_without_weights(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=r"No weights in the directory .*model\.safetensors.*config\.json"):
        load_state_dict(tiny_bert_classifier(), tmp_path)


def test_missing_shard(tmp_path):
    tiny_bert_classifier().save_pretrained(tmp_path, max_shard_size="4KB")
    shard = sorted(f for f in os.listdir(tmp_path) if f.endswith(".safetensors"))[0]
    os.remove(tmp_path / shard)
    with pytest.raises(FileNotFoundError, match=f"lists the shard {shard}, which is not in"):
        load_state_dict(tiny_bert_classifier(), tmp_path)


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_corrupted_safetensors(tmp_path, damage):
    path = tmp_path / "model.safetensors"
    tiny_bert_classifier().save_pretrained(tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"\x00garbage" * 10)
    with pytest.raises(ValueError, match=f"Could not read the safetensors file {path}.*corrupted or truncated"):
        load_state_dict(tiny_bert_classifier(), tmp_path)


def test_corrupted_pickle(tmp_path):
    path = tmp_path / "w.bin"
    torch.save(tiny_bert_classifier().state_dict(), path)
    path.write_bytes(path.read_bytes()[:200])
    with pytest.raises(ValueError, match=f"Could not read {path} as a PyTorch pickle"):
        load_state_dict(tiny_bert_classifier(), path)


def test_another_architecture(tmp_path):
    _bert_mlm(0).save_pretrained(tmp_path)
    with pytest.raises(ValueError) as err:
        load_state_dict(tiny_bert_classifier(), tmp_path)
    message = str(err.value)
    assert f"Cannot load {tmp_path} into BertForSequenceClassification strictly" in message
    assert "classifier.weight" in message and "cls.predictions.bias" in message  # missing and unexpected, named
    assert "strict=False" in message


def test_another_configuration_shapes(tmp_path):
    tiny_bert_classifier(num_labels=3).save_pretrained(tmp_path)
    with pytest.raises(
        ValueError, match=r"shapes differ .*classifier\.weight: \(3, 16\) in the checkpoint, \(2, 16\)"
    ):
        load_state_dict(tiny_bert_classifier(num_labels=2), tmp_path)


class _NotATensor:
    pass


def test_pickle_refused_by_weights_only(tmp_path):
    path = tmp_path / "whole_model.pt"
    torch.save({"weight": torch.ones(2), "extra": _NotATensor()}, path)
    with pytest.raises(ValueError, match=f"Refusing to load {path}.*weights_only=False"):
        load_state_dict(tiny_bert_classifier(), path)


def test_training_checkpoint_dict(tmp_path):
    path = tmp_path / "ckpt.pt"
    torch.save({"model": tiny_bert_classifier().state_dict(), "step": 3}, path)
    with pytest.raises(ValueError, match=r"not a plain state dict: the entries model, step are not tensors"):
        read_state_dict(path)
    with pytest.raises(TypeError, match="got int"):
        load_state_dict(tiny_bert_classifier(), 3)


# ---- A model whose own load_state_dict adapts buffers: torch.ao quantization-aware training ----

QAT_BACKENDS = ["fbgemm", "x86"]


@pytest.mark.parametrize("backend", QAT_BACKENDS)
@pytest.mark.parametrize("file_name", ["model.safetensors", "pytorch_model.bin"])
def test_quantization_aware_model_loads_strictly(backend, file_name, tmp_path):
    source = qat_model(0, backend=backend)
    for _ in range(2):  # the per-channel observers take one value per output channel
        source(torch.randn(5, 4))
    saved = source.state_dict()
    assert saved["fc.weight_fake_quant.scale"].shape == (3,)
    if file_name.endswith(".safetensors"):
        safetensors.torch.save_file({k: v.contiguous() for k, v in saved.items()}, tmp_path / file_name)
    else:
        torch.save(saved, tmp_path / file_name)
    target = qat_model(1, backend=backend)
    placeholders = {"fc.weight_fake_quant.scale": (1,), "fc.weight_fake_quant.activation_post_process.min_val": (0,)}
    for key, shape in placeholders.items():
        assert target.state_dict()[key].shape == shape, key

    assert load_state_dict(target, tmp_path, strict=True) == ([], [])
    assert_same_weights(target.state_dict(), source.state_dict(), atol=0)
    x = torch.randn(3, 4)
    torch.testing.assert_close(target(x)["logits"], source(x)["logits"], rtol=0, atol=0)


def test_another_architecture_of_a_quantization_aware_model(tmp_path):
    torch.save(qat_model(0, out_features=3).state_dict(), tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError) as err:
        load_state_dict(qat_model(1, out_features=5), tmp_path, strict=True)
    message = str(err.value)
    # torch's size mismatch, re-raised with the path and the fix; the observers it resizes are not named.
    assert message.startswith(f"Cannot load {tmp_path} into TinyRegressor: shapes differ for 2")
    assert "fc.weight: (3, 4) in the checkpoint, (5, 4) in the model; fc.bias: (3,) in the checkpoint, (5,)" in message
    assert "fake_quant" not in message and "from_pretrained" in message

    # A model without fake-quantize modules saved the checkpoint: the model's observer keys are missing, named.
    torch.save(TinyRegressor().state_dict(), tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"strictly: 14 model weights are missing from it \(fc\.activation_post"):
        load_state_dict(qat_model(1), tmp_path, strict=True)


class _RefusesEveryLoad(nn.Linear):
    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing, unexpected, error_msgs):
        error_msgs.append("this module refuses every state dict")


def test_other_refusals_of_the_model_name_the_source():
    source = nn.Linear(2, 2).state_dict()
    with pytest.raises(
        RuntimeError, match=r"(?s)Cannot load the state dict into _RefusesEveryLoad: .*refuses every state"
    ):
        load_state_dict(_RefusesEveryLoad(2, 2), source)
