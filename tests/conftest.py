import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


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


def pytest_collection_modifyitems(config, items):
    n_gpu = torch.cuda.device_count()
    for item in items:
        # Markers only: item.keywords also holds parametrize ids, and an id like "multi_gpu" must not skip a test.
        if item.get_closest_marker("gpu") is not None and n_gpu < 1:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        if item.get_closest_marker("multi_gpu") is not None and n_gpu < 2:
            item.add_marker(pytest.mark.skip(reason="needs two or more CUDA GPUs"))
