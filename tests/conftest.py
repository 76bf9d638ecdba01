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


@pytest.fixture(scope="session")
def tiny_assets(tmp_path_factory):
    from tests.fixtures import make_tiny_assets

    return make_tiny_assets(tmp_path_factory.mktemp("tiny"))


@pytest.fixture
def compose_cfg(tiny_assets, tmp_path):
    """Compose conf/train.yaml with the tiny assets swapped in, plus the given overrides."""
    from pathlib import Path

    from hydra import compose, initialize_config_dir

    import distill.train  # noqa: F401  (registers the distill_demo resolver)

    conf = Path(__file__).resolve().parents[1] / "conf"

    def _compose(*overrides, out=None):
        base = [f"paths.output_dir={out or tmp_path / 'out'}",
                f"student.name_or_path={tiny_assets['student']}",
                f"teacher.name_or_path={tiny_assets['teacher']}",
                f"paths.data={tiny_assets['sft_train'].parent}",
                "evaluate=null", "data.batch_size=4", "trainer.val_check_interval=5",
                "trainer.log_every_n_steps=1", "callbacks.progress.refresh_rate=0"]
        with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
            return compose("train", overrides=base + list(overrides))

    return _compose
