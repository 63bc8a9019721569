import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from hf_parallel.launch.environment import LAUNCH_VARIABLES, WORLD_SIZE_VARIABLES  # noqa: E402
from tests.helpers.harness import record_hf_parallel_log  # noqa: E402


@pytest.fixture(autouse=True)
def _restore_environ():
    """Tests and the Trainer set launcher variables (WORLD_SIZE, ACCELERATE_*): never let them leak."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(autouse=True)
def _no_leftover_process_group():
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(autouse=True)
def _reset_accelerate_state():
    """accelerate keeps its state in singletons; a test that formed a topology must not hand it to the next."""
    yield
    from accelerate.state import AcceleratorState, PartialState

    AcceleratorState._reset_state(reset_partial_state=True)
    PartialState._reset_state()


@pytest.fixture
def no_launcher(monkeypatch):
    """No launcher variable is set (WORLD_SIZE, RANK, ACCELERATE_*, ...); returns `monkeypatch`, to set some."""
    for name in WORLD_SIZE_VARIABLES + LAUNCH_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.fixture
def no_gpus(monkeypatch):
    """
    This process sees no CUDA device, whatever the machine has: for tests about CPU behaviour, whose outcome must
    not change on a GPU machine. torch finds no GPU, and so do transformers (`TrainingArguments.n_gpu`, the device),
    accelerate (`PartialState`), `nn.DataParallel` (which, on one GPU, moves the model to it when built) and
    hf_parallel, since they all ask `torch.cuda`. CUDA counts as never initialised, as without a GPU, even after an
    earlier test initialised it. Processes the test starts need `NO_GPUS` (tests/helpers/paths.py) in their environment
    instead. Returns `monkeypatch`.
    """
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    return monkeypatch


@pytest.fixture
def hf_parallel_log():
    """The warnings of the `hf_parallel` loggers during the test: `.records`, `.messages`, `.text`."""
    with record_hf_parallel_log() as log:
        yield log


def pytest_collection_modifyitems(config, items):
    n_gpu = torch.cuda.device_count()
    for item in items:
        # Markers only: item.keywords also holds parametrize ids, and an id like "multi_gpu" must not skip a test.
        if item.get_closest_marker("gpu") is not None and n_gpu < 1:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        if item.get_closest_marker("multi_gpu") is not None and n_gpu < 2:
            item.add_marker(pytest.mark.skip(reason="needs two or more CUDA GPUs"))
