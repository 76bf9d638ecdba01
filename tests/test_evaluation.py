"""task_accuracy: exact match per task, and batched left-padded decoding that matches greedy."""

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

import distill
from distill.demo.evaluation import generate_answers, load_examples, task_accuracy

ASSETS = Path(distill.__file__).parent / "demo" / "assets"


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(ASSETS / "tokenizer")


def _chat(prompt, answer, task):
    return {
        "messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}],
        "task": task,
    }


EXAMPLES = [
    _chat("add 12+30", "42", "addition"),
    _chat("add 999+1", "1000", "addition"),
    _chat("reverse abc", "cba", "reversal"),
    _chat("reverse hello", "olleh", "reversal"),
    _chat("sort 3142", "1234", "sorting"),
]


class ScriptedModel(torch.nn.Module):
    """Answers each prompt from a table; checks it is given left-padded prompts."""

    def __init__(self, tokenizer, answers: dict[str, str]):
        super().__init__()
        self.anchor = torch.nn.Parameter(torch.zeros(1))
        self.tokenizer, self.answers = tokenizer, answers

    def generate(
        self, input_ids, attention_mask, max_new_tokens, pad_token_id, eos_token_id, **kwargs
    ):
        assert kwargs["do_sample"] is False
        rows = []
        for ids, mask in zip(input_ids.tolist(), attention_mask.tolist()):
            assert mask == sorted(mask), "prompts must be left-padded"
            prompt = self.tokenizer.decode(ids, skip_special_tokens=True)
            answer = self.tokenizer(" " + self.answers[prompt] + " ", add_special_tokens=False)
            new = answer["input_ids"][: max_new_tokens - 1] + [eos_token_id]
            rows.append(ids + new + [pad_token_id] * (max_new_tokens - len(new)))
        return torch.tensor(rows)


def _table(examples, wrong_task=None):
    return {
        ex["messages"][0]["content"]: "nope"
        if ex["task"] == wrong_task
        else ex["messages"][1]["content"]
        for ex in examples
    }


def test_a_model_that_knows_the_answers_scores_one(tokenizer):
    model = ScriptedModel(tokenizer, _table(EXAMPLES))
    result = task_accuracy(model, tokenizer, EXAMPLES, batch_size=2)
    assert result == {
        "overall": 1.0,
        "per_task": {"addition": 1.0, "reversal": 1.0, "sorting": 1.0},
        "n": 5,
    }


def test_wrong_answers_count_against_their_task_only(tokenizer):
    model = ScriptedModel(tokenizer, _table(EXAMPLES, wrong_task="reversal"))
    result = task_accuracy(model, tokenizer, EXAMPLES, batch_size=3)
    assert result["per_task"] == {"addition": 1.0, "reversal": 0.0, "sorting": 1.0}
    assert result["overall"] == pytest.approx(3 / 5)


def test_answers_come_back_in_input_order(tokenizer):
    model = ScriptedModel(tokenizer, _table(EXAMPLES))
    answers = generate_answers(model, tokenizer, EXAMPLES, batch_size=2)
    assert [a.strip() for a in answers] == [ex["messages"][1]["content"] for ex in EXAMPLES]


def test_batched_decoding_matches_one_prompt_at_a_time_greedy(tokenizer):
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(ASSETS / "student"))
    answers = generate_answers(model, tokenizer, EXAMPLES, max_new_tokens=6, batch_size=5)
    model.eval()
    for ex, answer in zip(EXAMPLES, answers):
        ids = tokenizer.apply_chat_template(
            ex["messages"][:1], tokenize=True, add_generation_prompt=True, return_dict=True
        )["input_ids"]
        ids, new = torch.tensor([ids]), []
        with torch.no_grad():
            for _ in range(6):
                token = model(input_ids=ids).logits[0, -1].argmax().item()
                if token == tokenizer.eos_token_id:
                    break
                new.append(token)
                ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
        assert answer == tokenizer.decode(new, skip_special_tokens=True)
    assert model.training is False


def test_training_mode_is_restored(tokenizer):
    model = ScriptedModel(tokenizer, _table(EXAMPLES)).train()
    task_accuracy(model, tokenizer, EXAMPLES[:1])
    assert model.training


def test_load_examples_reads_jsonl_with_a_limit(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_text("\n".join(json.dumps(ex) for ex in EXAMPLES) + "\n\n")
    assert load_examples(path) == EXAMPLES
    assert load_examples(path, limit=2) == EXAMPLES[:2]


def test_no_examples_is_an_error(tokenizer):
    with pytest.raises(ValueError, match="at least one example"):
        task_accuracy(ScriptedModel(tokenizer, {}), tokenizer, [])


def test_summary_prints_the_recorded_reference_beside_the_student(capsys):
    from distill.demo.task_eval import references_for
    from distill.run.report import print_summary
    from distill.training.objective import LossConfig

    ref = {"name": "CE-only", "overall": 0.125, "per_task": {"reversal": 0.05, "sorting": 0.2},
           "note": "mean of 3 seeds", "command": "python -m distill.train +experiment=x "
           "+baseline=ce_only", "baseline": "ce_only"}
    seqkd = {**ref, "name": "SeqKD", "baseline": "seqkd", "command": "... +baseline=seqkd"}
    distilled = LossConfig(divergence_weight=1.0)
    summary = {"student_dir": None, "global_step": 3, "wall_s": 1.0, "metrics": {},
               "accuracy": {"distilled student": {"overall": 0.5, "per_task": {}}},
               "references": references_for([ref, seqkd], distilled), "trained_tokens": 1234}
    print_summary(summary)
    out = capsys.readouterr().out
    assert "trained tokens:   1234" in out
    assert " 12.5%   reversal 5%  sorting 20%   (mean of 3 seeds)" in out
    assert "+experiment=x +baseline=ce_only" in out
    assert out.index("distilled student") < out.index("CE-only") < out.index("SeqKD")
    # a baseline's own run does not print itself as a reference
    ce_only = LossConfig(divergence_weight=0.0, ce_weight=1.0)
    assert [r["name"] for r in references_for([ref, seqkd], ce_only)] == ["SeqKD"]


def test_a_permutation_example_accepts_any_ordering_of_its_letters(tmp_path):
    from distill.demo.evaluation import is_correct

    example = {**_chat("permute cab", "abc", "permutation"), "match": "permutation"}
    assert is_correct("bca", example) and is_correct(" abc ", example)
    assert not is_correct("bc", example) and not is_correct("abcc", example)
    assert not is_correct("bca", _chat("permute cab", "abc", "permutation"))  # exact
    bad = tmp_path / "tasks.jsonl"
    bad.write_text(json.dumps({**example, "match": "fuzzy"}) + "\n")
    with pytest.raises(ValueError, match=r"line 1 .*match='fuzzy'; the rules are \['exact', "
                                         r"'permutation'\]"):
        load_examples(bad)


def test_the_scale_comparison_reads_the_real_run_summary():
    """scripts/compare_at_scale.py parses each run's printed summary (report.summary_lines)."""
    from distill.run.report import summary_lines
    from tests.fixtures import load_script

    script = load_script("scripts/compare_at_scale.py")
    summary = {"student_dir": None, "global_step": 500, "wall_s": 107.4, "metrics": {},
               "trained_tokens": 280484, "references": [],
               "accuracy": {"teacher": {"overall": 1.0, "per_task": {"permutation": 1.0}},
                            "untrained student": {"overall": 0.0, "per_task": {}},
                            "distilled student": {"overall": 0.965, "per_task": {}}}}
    got = script.scores("\n".join(summary_lines(summary)))
    assert got == {"teacher": 100.0, "distilled student": 96.5, "steps": 500, "train_s": 107,
                   "trained_tokens": 280484}


def test_the_demo_records_every_baseline_with_the_command_that_measures_it():
    """conf/experiment/onpolicy_demo.yaml's references: the recipe itself and one entry per
    conf/baseline/*.yaml, each a fraction with the command (+baseline=<name>) it came from."""
    import yaml

    conf = Path(distill.__file__).parent / "conf"
    refs = yaml.safe_load((conf / "experiment" / "onpolicy_demo.yaml").read_text())[
        "evaluate"]["references"]
    baselines = sorted(p.stem for p in (conf / "baseline").glob("*.yaml"))
    assert sorted(r["baseline"] for r in refs if "baseline" in r) == baselines
    for ref in refs:
        assert 0 <= ref["overall"] <= 1 and "3 seeds" in ref["note"]
        assert ref["command"].startswith("python -m distill.train +experiment=onpolicy_demo")
        if "baseline" in ref:
            assert f"+baseline={ref['baseline']}" in ref["command"]


def test_the_readme_shows_the_recorded_references():
    """The README's demo table holds the same 3-seed means as the config's references."""
    import re

    import yaml

    root = Path(__file__).resolve().parents[1]
    refs = yaml.safe_load((root / "distill/conf/experiment/onpolicy_demo.yaml").read_text())[
        "evaluate"]["references"]
    readme = (root / "README.md").read_text()
    for ref in refs:
        switch = f"`+baseline={ref['baseline']}`" if "baseline" in ref else "`make demo`"
        row = re.search(rf"^\|[^|\n]*{re.escape(switch)}[^|\n]*\| \**([\d.]+)%", readme, re.M)
        assert row, f"no README row for {switch}"
        assert float(row[1]) == round(100 * ref["overall"], 1), switch
