"""A small causal language model the language-modelling tests train: a byte-level BPE tokenizer trained on the
Zen of Python (``tokenizers``) and a two-layer GPT-2 from its config, saved as ``save_pretrained`` saves a
downloaded one, with the text beside them."""

from __future__ import annotations

import codecs
import this
from pathlib import Path

ZEN = [line for line in codecs.decode(this.s, "rot13").splitlines() if line.strip()]


def make_lm(root: Path, repeats: int = 4) -> Path:
    """``root/model`` (tokenizer and GPT-2) and ``root/zen.txt`` (the Zen ``repeats`` times); returns ``root``."""
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(ZEN, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<eos>", "<pad>"],
                                                     initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>",
                                                pad_token="<pad>")
    fast.save_pretrained(root / "model")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=len(fast), n_positions=64, n_embd=32, n_layer=2, n_head=4,
                                  eos_token_id=fast.eos_token_id, bos_token_id=fast.eos_token_id,
                                  pad_token_id=fast.pad_token_id)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(root / "model")
    (root / "zen.txt").write_text("\n".join(ZEN * repeats) + "\n")
    return root
