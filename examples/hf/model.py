"""The bind module of examples/hf/story.lmpm (and rows.lmpm): the bundled GPT-2 as `GPT`, and
`Words(...)`, the tokens whose text holds one of the given words.

The model and its tokenizer were trained by scripts/train_hf.py on the captions of the generated
world and saved in examples/hf/model/ as `transformers` saves them; nothing is downloaded.

    lmpm run examples/hf/story.lmpm --bind examples/hf/model.py \\
        --tokenizer BPE=examples/hf/model --input Txt=examples/hf/prompt.txt --out runs/story
"""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is local: never ask the Hub

from tokenizers import Tokenizer
from transformers.utils import logging as hf_logging

import lmpm
from lmpm.models.hf import HFCausalLM

MODEL = Path(__file__).resolve().parent / "model"
hf_logging.disable_progress_bar()  # (its "Loading weights" bar would land in lmpm's output)
_tokenizer = Tokenizer.from_file(str(MODEL / "tokenizer.json"))

# The model over the causal read `context`: a KV cache reused across epochs (only the new token is
# fed each epoch), logits handed back to the worker, which masks them with the lowered constraints
# (NoRed) and takes the top k (docs/models.md, "Bring your own model").
lmpm.bind("GPT")(HFCausalLM.from_pretrained(MODEL))


@lmpm.bind("Words")
def words(*banned: str) -> list[int]:
    """The ids of the tokens whose text contains one of ``banned`` (any case)."""
    wanted = [w.lower() for w in banned]
    return [
        i
        for i in range(_tokenizer.get_vocab_size())
        if any(w in _tokenizer.decode([i]).lower() for w in wanted)
    ]
