"""Load student and teacher causal LMs, and reach their final hidden states and LM heads.

The loss never calls a model's full forward (that would build the logits): it takes the
base model's last hidden state (after the final norm) and the output-embedding weight,
plus the head extras some families add (bias, logit scale, soft-capping).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from distill.core.constants import MODEL_DTYPES
from distill.ops.spec import HeadTransform


def looks_like_hub_name(name: str) -> bool:
    """Hub names are "name" or "org/name"; anything else (./, /, ~, deeper) is meant as a
    local folder."""
    return not name.startswith((".", "/", "~")) and name.count("/") <= 1


def resolve_path(name_or_path: str) -> str:
    """A local path must exist; anything else is passed on as a hub name."""
    looks_local = not looks_like_hub_name(name_or_path)
    path = Path(name_or_path).expanduser()
    if path.exists():
        return str(path)
    if looks_local:
        raise FileNotFoundError(
            f"model path {name_or_path!r} does not exist: point student.name_or_path / "
            "teacher.name_or_path at a Hugging Face model folder or a hub name (the demo's "
            "models are in distill/demo/assets; scripts/make_demo_assets.py rebuilds them)"
        )
    return name_or_path


# what a Hugging Face folder needs (any one file of each tuple), to name what is missing
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "spiece.model", "vocab.json",
                   "vocab.txt", "tekken.json")
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")


def missing_files(path: str, what: str, who: str = "student") -> str | None:
    """For a local folder: a sentence saying which files `what` needs and it lacks; `who`
    (student or teacher) names the keys that fix it."""
    folder = Path(path)
    if not folder.is_dir():
        return None
    names = {p.name for p in folder.iterdir()}
    found = ", ".join(sorted(names)[:8]) or "nothing"
    if what == "tokenizer" and not (names & set(TOKENIZER_FILES)
                                    or any(n.endswith(".tiktoken") for n in names)):
        kind = "tokenizer" if "config.json" in names else "model or tokenizer"
        return (f"the folder {path} has no {kind} files (it holds {found}): a tokenizer "
                "folder needs tokenizer.json (or tokenizer.model, or vocab.json + "
                "merges.txt) and tokenizer_config.json, as tokenizer.save_pretrained writes "
                "them, and a model folder needs config.json and model.safetensors. Point "
                f"{who}.tokenizer= (it defaults to {who}.name_or_path) at a folder with the "
                "tokenizer" + (", often the teacher's" if who == "student" else ""))
    if what in ("model", "config") and "config.json" not in names:
        return (f"the folder {path} has no model files (it holds {found}): a model folder "
                "needs config.json and its weights (model.safetensors or shards), as "
                "model.save_pretrained writes them")
    if what == "model" and not names & set(WEIGHT_FILES):
        fix = ("or set student.from_scratch=true to start from random weights" if who ==
               "student" else "a teacher needs its trained weights: point "
               "teacher.name_or_path at the folder that holds them")
        return (f"the folder {path} has config.json but no weights (it holds {found}): add "
                f"model.safetensors (or its shards), {fix}")
    return None


def safetensors_problem(path: Path) -> str | None:
    """Why a .safetensors file cannot be whole, from its header alone (None when it can):
    a download or copy that stopped early leaves a file shorter than its header says."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if n < 0 or n > size - 8:
            return f"it holds {size} bytes, too few for the header it starts with"
        try:
            header = json.loads(f.read(n))
        except ValueError:
            return "its header is not valid JSON"
    end = max((v["data_offsets"][1] for k, v in header.items()
               if k != "__metadata__" and isinstance(v, dict)), default=0)
    if 8 + n + end > size:
        return f"it holds {size} bytes but its header describes {8 + n + end}"
    return None


def check_weights(path: str) -> None:
    """The safetensors files of a local model folder are whole, and every shard its index
    names is there: else an error naming the file (transformers' names none)."""
    folder = Path(path)
    if not folder.is_dir():
        return
    index = folder / "model.safetensors.index.json"
    files = sorted(folder.glob("*.safetensors"))
    if index.exists():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError) as err:
            raise OSError(f"{index} is damaged ({type(err).__name__}: {err}): save or "
                          "download the model again") from err
        missing = [s for s in shards if not (folder / s).exists()]
        if missing:
            raise FileNotFoundError(f"{folder} lacks {len(missing)} of the {len(shards)} weight "
                                    f"shards its index names ({', '.join(missing[:3])}): the "
                                    "download or copy did not finish")
    for file in files:
        why = safetensors_problem(file)
        if why:
            raise OSError(f"the weights file {file} is damaged: {why} (truncated: a download, "
                          "copy or save that did not finish). Download or save the model again")


def check_model_folder(name_or_path: str, from_scratch: bool = False,
                       who: str = "student") -> None:
    """Before anything loads: a local model folder holds what loading it will need, whole."""
    path = resolve_path(name_or_path)
    problem = missing_files(path, "config" if from_scratch else "model", who)
    if problem:
        raise FileNotFoundError(problem)
    if not from_scratch:
        check_weights(path)


def max_positions(name_or_path: str) -> int | None:
    """The positions a model was built for (its config's max_position_embeddings or the
    family's name for it); None when unknown or the config cannot be read here."""
    try:
        cfg = AutoConfig.from_pretrained(resolve_path(name_or_path))
    except (OSError, ValueError):
        return None  # a hub name offline: loading it will say so
    return config_positions(cfg)


def config_positions(config) -> int | None:
    """The positions a model config names (max_position_embeddings or the family's name
    for it, in its text config); None when it names none."""
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        if isinstance(getattr(cfg, key, None), int):
            return getattr(cfg, key)
    return None


def check_positions(longest: int, models: dict[str, str]) -> None:
    """Refuse examples longer than a model's positions: learned position embeddings would
    index past their table, and rotary models were never trained there (transformers only
    warns). `models`: {"student": name_or_path, ...}."""
    for who, name in models.items():
        limit = max_positions(name)
        if limit is not None and longest > limit:
            raise ValueError(
                f"the longest example has {longest} tokens but the {who} ({name}) has "
                f"{limit} positions (max_position_embeddings in its config.json): lower "
                f"data.max_length to {limit} or less (longer examples are then truncated, "
                "and said so), or use a model built for longer inputs")


def load_tokenizer(name_or_path: str, who: str = "student"):
    path = resolve_path(name_or_path)
    try:
        tok = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as err:
        # transformers blames a missing sentencepiece when a folder has no tokenizer at all
        problem = missing_files(path, "tokenizer", who)
        if problem:
            raise FileNotFoundError(problem) from err
        raise OSError(f"could not load a tokenizer from {name_or_path!r} ({err}); offline "
                      "machines need a local folder or a pre-filled HF cache") from err
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def load_causal_lm(name_or_path: str, dtype: str = "float32", from_scratch: bool = False,
                   attn_implementation: str | None = None, seed: int | None = None,
                   **kwargs) -> PreTrainedModel:
    """AutoModelForCausalLM from a local folder or hub name; `from_scratch` keeps only
    the config (random init), as the demo student does."""
    path = resolve_path(name_or_path)
    if not from_scratch:
        check_weights(path)
    torch_dtype = MODEL_DTYPES[dtype]
    extra = {"attn_implementation": attn_implementation} if attn_implementation else {}
    try:
        if from_scratch:
            config = AutoConfig.from_pretrained(path)
            if seed is not None:
                torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(config, **extra)
            return model.to(torch.float32 if torch_dtype == "auto" else torch_dtype)
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, **extra, **kwargs)
    except (OSError, ValueError) as err:
        problem = missing_files(path, "config" if from_scratch else "model")
        if problem:
            raise FileNotFoundError(problem) from err
        if isinstance(err, ValueError):
            raise
        raise OSError(f"could not load a causal LM from {name_or_path!r}: {err}") from err


def base_model(model: PreTrainedModel) -> torch.nn.Module:
    """The decoder without its LM head (LlamaForCausalLM.model, GPT2LMHeadModel.transformer)."""
    return getattr(model, model.base_model_prefix)


def final_hidden_states(model, input_ids, attention_mask=None, position_ids=None):
    """(B, T, H) last hidden state after the final norm, without building logits.

    `position_ids` mark packed rows (distill.data.pack): the model then gets no attention
    mask, so that transformers builds a per-document causal mask from the position ids
    (sdpa, eager, flex; right padding is a document of its own, which no real token
    attends to). Flash attention finds the documents only in a batch of one row, so for it
    the batch is flattened to (1, B * T) first.
    """
    base = base_model(model)
    if position_ids is None:
        return base(input_ids=input_ids, attention_mask=attention_mask,
                    use_cache=False).last_hidden_state
    b, t = input_ids.shape
    if uses_flash_attention(model) and b > 1:
        flat = base(input_ids=input_ids.reshape(1, b * t),
                    position_ids=position_ids.reshape(1, b * t), use_cache=False)
        return flat.last_hidden_state.reshape(b, t, -1)
    return base(input_ids=input_ids, position_ids=position_ids,
                use_cache=False).last_hidden_state


def uses_flash_attention(model) -> bool:
    return str(getattr(model.config, "_attn_implementation", "")).startswith("flash")


def lm_head(model: PreTrainedModel) -> tuple[torch.Tensor, HeadTransform]:
    """The LM-head weight (V, H) (tied embeddings work) and its extras.

    The extras are read from the config keys the families' forward() applies after the
    head's matmul: Cohere multiplies by `logit_scale`, Granite divides by `logits_scaling`
    (a scale of 1 / logits_scaling: no bias in between, so the order does not matter),
    Gemma 2 / 3 soft-cap with `final_logit_softcapping`. A family that does anything else
    is caught at the first batch by distill.training.callbacks.HeadCheck.
    """
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear):
        raise TypeError(f"unsupported LM head {type(head).__name__}: distill needs a Linear "
                        "output projection")
    cfg = model.config.get_text_config()
    scale = 1.0
    if getattr(cfg, "logit_scale", None):
        scale *= float(cfg.logit_scale)
    if getattr(cfg, "logits_scaling", None):
        scale /= float(cfg.logits_scaling)
    softcap = getattr(cfg, "final_logit_softcapping", None)
    return head.weight, HeadTransform(bias=head.bias, scale=scale, softcap=softcap)


def check_head_rows(model: PreTrainedModel, vocab: int, who: str) -> None:
    rows = model.get_output_embeddings().weight.shape[0]
    if rows < vocab:
        raise ValueError(f"the {who} LM head has {rows} rows but the tokenizer has {vocab} "
                         "tokens: resize its embeddings or use the matching tokenizer")


def trainable_dtype(dtype: str, precision: str | int) -> torch.dtype | None:
    """The dtype the student's trainable weights, and so AdamW's state, are kept in.

    Lightning's '*-true' precisions convert the whole module; '*-mixed' keep the weights
    as loaded and only autocast the compute. None for dtype='auto' (the checkpoint's).
    """
    converted = {"bf16-true": torch.bfloat16, "16-true": torch.float16,
                 "64-true": torch.float64, "64": torch.float64, "transformer-engine": None}
    precision = str(precision)
    if precision in converted:
        return converted[precision]
    loaded = MODEL_DTYPES[dtype]
    return None if loaded == "auto" else loaded
