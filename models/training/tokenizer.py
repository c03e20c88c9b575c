"""Byte-level BPE tokenizer for the shipped tiny model (trained with the `tokenizers` library).

Byte-level means every string round-trips (no unknown tokens), which matters for source code full of
odd characters. The files written here (`tokenizer.json` + `tokenizer_config.json`) are what
`transformers.AutoTokenizer.from_pretrained(dir)` expects for a `PreTrainedTokenizerFast`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOS_TOKEN = "<|endoftext|>"  # end of document; also the separator between concatenated training files


def train_bpe(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Train a GPT-2-style byte-level BPE on `texts`; the EOS special token gets id 0."""
    tok = Tokenizer(models.BPE())
    # add_prefix_space=False: code is not prose, a file's first token should not get a fake leading space.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes, so nothing is ever unknown
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def save_tokenizer(tok: Tokenizer, path: str | Path, model_max_length: int) -> None:
    """Write tokenizer.json and a tokenizer_config.json that AutoTokenizer understands."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS_TOKEN,
        "bos_token": None,
        "pad_token": EOS_TOKEN,  # batching needs some pad id; EOS is harmless as padding for a causal LM
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def load_tokenizer(path: str | Path) -> Tokenizer:
    """The raw `tokenizers` object from a checkpoint directory (no transformers import needed)."""
    return Tokenizer.from_file(str(Path(path) / "tokenizer.json"))
