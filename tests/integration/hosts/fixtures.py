"""What the hosts' stock examples download, made locally: a text corpus and a word-level tokenizer.

The examples read a dataset and a tokenizer from the Hub; nothing can be downloaded here, so the
same kinds of objects are built from a fixed vocabulary (``datasets`` reads the text files exactly
as it reads a user's ``--train_file``).
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

WORDS = [f"w{i}" for i in range(60)]


def write_corpus(directory: str | os.PathLike[str], lines: int = 96, seed: int = 0) -> dict[str, str]:
    """``train.txt`` / ``validation.txt`` / ``train.jsonl`` of short sentences that follow a learnable rule."""
    rng = random.Random(seed)
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)

    def sentence() -> str:
        start = rng.randrange(len(WORDS))
        return " ".join(WORDS[(start + 7 * k) % len(WORDS)] for k in range(rng.randrange(8, 20)))

    train = [sentence() for _ in range(lines)]
    validation = [sentence() for _ in range(lines // 4)]
    (out / "train.txt").write_text("\n".join(train) + "\n")
    (out / "validation.txt").write_text("\n".join(validation) + "\n")
    with (out / "train.jsonl").open("w") as f:
        for text in train:
            f.write(json.dumps({"text": text}) + "\n")
    with (out / "pairs.jsonl").open("w") as f:  # preference pairs for DPO: the rule's continuation is preferred
        for text in train[: lines // 2]:
            words = text.split()
            prompt, chosen = " ".join(words[:5]), " ".join(words[5:9])
            rejected = " ".join(reversed(words[5:9]))
            f.write(json.dumps({"prompt": prompt, "chosen": " " + chosen, "rejected": " " + rejected}) + "\n")
    return {name: str(out / name) for name in ("train.txt", "validation.txt", "train.jsonl", "pairs.jsonl")}


def write_tokenizer(directory: str | os.PathLike[str]) -> str:
    """A word-level fast tokenizer over ``WORDS`` saved with ``save_pretrained`` (loads with AutoTokenizer)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[PAD]": 0, "[UNK]": 1, "[EOS]": 2, "[CLS]": 3, "[SEP]": 4, **{w: i + 5 for i, w in enumerate(WORDS)}}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        unk_token="[UNK]",
        pad_token="[PAD]",
        eos_token="[EOS]",
        bos_token="[EOS]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        model_max_length=64,
    )
    tokenizer.save_pretrained(directory)
    return str(directory)


def write_gpt2_config(directory: str | os.PathLike[str]) -> str:
    """A tiny GPT-2 config directory (``--config_name``), vocabulary sized for ``write_tokenizer``."""
    from transformers import GPT2Config

    GPT2Config(
        n_layer=2,
        n_embd=32,
        n_head=2,
        vocab_size=len(WORDS) + 5,
        n_positions=64,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=2,
        eos_token_id=2,
        pad_token_id=0,
    ).save_pretrained(directory)
    return str(directory)
