import os
import random

import pytest
import torch

# Tolerances written once per dtype: (rtol, atol) on the loss and every gradient.
TOLERANCES = {torch.float64: (1e-9, 1e-11), torch.float32: (2e-5, 1e-6),
              torch.bfloat16: (3e-2, 1e-3), torch.float16: (1e-2, 1e-4)}


@pytest.fixture(autouse=True)
def _seed():
    random.seed(0)
    torch.manual_seed(0)
    yield


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
