"""unwrap_model and load_state_dict: every wrapper in any order, every file format, and a clear error for bad input."""

import json
import os

import pytest
import safetensors.torch
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from transformers import BertForMaskedLM

from hf_parallel import load_state_dict, unwrap_model
from hf_parallel.unwrap import clean_state_dict, has_wrapper_prefixes, match_keys, read_state_dict
from tests.tiny import tiny_bert_classifier, tiny_bert_config

try:  # written under another issue; a plain DataParallel subclass stands in until it lands
    from hf_parallel import BalancedDataParallel
except ImportError:
    BalancedDataParallel = None


class _DataParallelSubclass(nn.DataParallel):
    pass


def _balanced(module):
    if BalancedDataParallel is not None:
        return BalancedDataParallel(module, gpu0_bsz=1)
    return _DataParallelSubclass(module)


def _compiled(module):
    return torch.compile(module, backend="eager")


@pytest.fixture
def gloo_world_of_one(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rdv'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _ddp(module):
    return nn.parallel.DistributedDataParallel(module)


def _same_weights(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        torch.testing.assert_close(sa[name], sb[name], rtol=0, atol=0, msg=name)


WRAPPER_STACKS = {
    "dp": [nn.DataParallel],
    "balanced": [_balanced],
    "compile": [_compiled],
    "ddp": [_ddp],
    "dp(compile)": [_compiled, nn.DataParallel],
    "compile(dp)": [nn.DataParallel, _compiled],
    "ddp(compile)": [_compiled, _ddp],
    "compile(ddp(balanced))": [_balanced, _ddp, _compiled],
    "dp(dp)": [nn.DataParallel, nn.DataParallel],
}


@pytest.mark.parametrize("stack", list(WRAPPER_STACKS))
def test_unwrap_any_nesting(stack, gloo_world_of_one):
    model = tiny_bert_classifier()
    wrapped = model
    for wrap in WRAPPER_STACKS[stack]:
        wrapped = wrap(wrapped)
    assert wrapped is not model
    assert unwrap_model(wrapped) is model
    keys = list(wrapped.state_dict())
    assert all(k.split(".")[0] in ("module", "_orig_mod") for k in keys)
    assert has_wrapper_prefixes(keys, wrapped)
    assert not has_wrapper_prefixes(model.state_dict().keys(), wrapped)
    clean = clean_state_dict(wrapped.state_dict(), wrapped)
    assert list(clean) == list(model.state_dict())

    fresh = tiny_bert_classifier(seed=1)
    result = load_state_dict(fresh, wrapped.state_dict())
    assert result.missing_keys == [] and result.unexpected_keys == []
    _same_weights(fresh, model)
    # ... and into a wrapped target: the weights land in the inner model.
    target = tiny_bert_classifier(seed=2)
    load_state_dict(nn.DataParallel(_compiled(target)), wrapped.state_dict())
    _same_weights(target, model)


def test_unwrap_plain_and_bad_input():
    model = tiny_bert_classifier()
    assert unwrap_model(model) is model
    with pytest.raises(TypeError, match="torch.nn.Module, got dict"):
        unwrap_model({"a": 1})


def test_unwrap_accelerate_engine_wrappers_by_name():
    # DeepSpeed's engine and FSDP cannot be built on a CPU box; accelerate hands them out with the model in `.module`.
    class DeepSpeedEngine(nn.Module):
        def __init__(self, module):
            super().__init__()
            self.module = module

    model = tiny_bert_classifier()
    assert unwrap_model(nn.DataParallel(DeepSpeedEngine(_compiled(model)))) is model


def test_accelerate_prepared_model_unwraps():
    from accelerate import Accelerator

    model = tiny_bert_classifier()
    prepared = Accelerator(cpu=True).prepare(_compiled(model))
    assert unwrap_model(prepared) is model


def test_real_submodule_named_module_is_kept():
    class Holder(nn.Module):
        def __init__(self):
            super().__init__()
            self.module = nn.Linear(3, 2)
            self.head = nn.Linear(2, 1)

    torch.manual_seed(0)
    source = Holder()
    target = Holder()
    load_state_dict(target, nn.DataParallel(source).state_dict())  # module.module.weight -> module.weight
    _same_weights(target, source)
    load_state_dict(target, source.state_dict())
    _same_weights(target, source)


def test_same_weight_under_two_prefixes_is_an_error():
    sd = tiny_bert_classifier().state_dict()
    sd["module.classifier.bias"] = sd["classifier.bias"].clone()
    with pytest.raises(ValueError, match=r"classifier\.bias <- \['classifier\.bias', 'module\.classifier\.bias'\]"):
        load_state_dict(tiny_bert_classifier(), sd)


BERT_KEYS = list(tiny_bert_classifier().state_dict())


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_match_keys_undoes_any_prefixes(data):
    model_keys = BERT_KEYS
    source = {}
    for key in model_keys:
        parts = key.split(".")
        # Insert wrapper components at random places, as nested or inner wrappers do.
        for _ in range(data.draw(st.integers(0, 3))):
            where = data.draw(st.integers(0, len(parts) - 1))
            parts.insert(where, data.draw(st.sampled_from(["module", "_orig_mod"])))
        source[".".join(parts)] = key
    mapping, unexpected = match_keys(source, model_keys)
    assert unexpected == []
    assert mapping == source


# ---- Files and directories ----


def _bert_mlm(seed):
    torch.manual_seed(seed)
    return BertForMaskedLM(tiny_bert_config())


def test_load_every_file_format(tmp_path):
    source = tiny_bert_classifier(seed=0)
    prefixed = nn.DataParallel(_compiled(source)).state_dict()
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
        _same_weights(target, source)
    target = tiny_bert_classifier(seed=1)
    load_state_dict(target, str(tmp_path / "sharded" / "model.safetensors.index.json"))
    _same_weights(target, source)


def test_tied_weights_are_not_missing(tmp_path):
    source = _bert_mlm(0)
    source.save_pretrained(tmp_path)
    stored = safetensors.torch.load_file(tmp_path / "model.safetensors")
    assert len(stored) < len(source.state_dict())  # save_pretrained writes tied weights once
    target = _bert_mlm(1)
    assert load_state_dict(target, tmp_path) == ([], [])
    _same_weights(target, source)
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
