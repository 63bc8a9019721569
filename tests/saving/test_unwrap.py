"""
unwrap_model and key matching: every wrapper in any order, its prefixes anywhere in a key, and a clear error for bad
input. Reading weight files, and their errors: test_checkpoints.py.
"""

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from hf_parallel import BalancedDataParallel, load_state_dict, unwrap_model
from hf_parallel.saving.unwrap import clean_state_dict, has_wrapper_prefixes, match_keys
from tests.helpers.harness import assert_same_weights
from tests.helpers.tiny import tiny_bert_classifier

# The wrappers are built on the CPU: on a machine with one GPU, nn.DataParallel would move the model to it when
# built, and its weights would no longer compare with the CPU copies.
pytestmark = pytest.mark.usefixtures("no_gpus")


def _balanced(module):
    return BalancedDataParallel(module, gpu0_bsz=1)


def _compiled(module):
    return torch.compile(module, backend="eager")


@pytest.fixture
def gloo_world_of_one(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rdv'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _ddp(module):
    return nn.parallel.DistributedDataParallel(module)


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
    assert_same_weights(fresh.state_dict(), model.state_dict(), atol=0)
    # ... and into a wrapped target: the weights land in the inner model.
    target = tiny_bert_classifier(seed=2)
    load_state_dict(nn.DataParallel(_compiled(target)), wrapped.state_dict())
    assert_same_weights(target.state_dict(), model.state_dict(), atol=0)


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
    assert_same_weights(target.state_dict(), source.state_dict(), atol=0)
    load_state_dict(target, source.state_dict())
    assert_same_weights(target.state_dict(), source.state_dict(), atol=0)


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
