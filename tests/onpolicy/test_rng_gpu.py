"""GPU only: a rollout on CUDA leaves the global random generators as they were, and its
samples are a function of the seed. `HFSampler` seeds `generate` inside
`torch.random.fork_rng` (CPU and the CUDA device); the static sampler draws from its own
counter-based stream. A rollout that moved the global CUDA generator would change the
training's dropout masks and every later draw, and one that ignored its seed would make
a resumed run sample other completions."""

import pytest
import torch

from distill.onpolicy.config import OnPolicyConfig
from distill.onpolicy.rollout import rollout
from distill.onpolicy.samplers import SamplingSettings
from distill.onpolicy.step import make_sampler
from tests.onpolicy.helpers import EOS, PAD, PROMPTS, VOCAB, tiny


def _window():
    width = max(len(p) for p in PROMPTS)
    ids = torch.tensor([p + [PAD] * (width - len(p)) for p in PROMPTS])
    attn = torch.tensor([[1] * len(p) + [0] * (width - len(p)) for p in PROMPTS])
    return [{"input_ids": ids, "attention_mask": attn, "labels": torch.full_like(ids, -100)}]


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["hf", "static"])
def test_a_cuda_rollout_keeps_the_global_generators_and_follows_its_seed(name):
    model = tiny("llama").cuda()
    sampler = make_sampler(name, SamplingSettings(1.0, 1.0, 12, [EOS], PAD, VOCAB), "cuda")
    cfg = OnPolicyConfig(fraction=1.0, max_new_tokens=12)

    def completions(seed):
        out, _ = rollout(_window(), cfg, seed, PAD, [EOS], sampler, model)
        return out[0]["input_ids"].tolist()

    torch.manual_seed(1234)  # seeds the CPU and every CUDA generator
    cpu, cuda = torch.random.get_rng_state(), torch.cuda.get_rng_state()
    a = completions(5)
    assert torch.equal(torch.cuda.get_rng_state(), cuda), "the rollout moved the CUDA generator"
    assert torch.equal(torch.random.get_rng_state(), cpu), "the rollout moved the CPU generator"
    drawn = torch.rand(8, device="cuda")  # what the training would draw next
    torch.cuda.set_rng_state(cuda)
    assert torch.equal(torch.rand(8, device="cuda"), drawn)
    # the same seed gives the same samples whatever the global state; another seed others
    torch.manual_seed(99)
    assert completions(5) == a
    assert completions(6) != a
