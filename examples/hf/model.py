"""The bind module of examples/hf/story.lmpm: the bundled GPT-2 as `GPT`, and `Words(...)`, the
tokens whose text holds one of the given words.

The model and its tokenizer were trained by scripts/train_hf.py on the captions of the generated
world and saved in examples/hf/model/ as `transformers` saves them; nothing is downloaded.

    lmpm run examples/hf/story.lmpm --bind examples/hf/model.py \\
        --tokenizer BPE=examples/hf/model --input Txt=examples/hf/prompt.txt --out runs/story
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is local: never ask the Hub

import torch
from tokenizers import Tokenizer
from transformers import GPT2LMHeadModel
from transformers.utils import logging as hf_logging

import lmpm

MODEL = Path(__file__).resolve().parent / "model"
hf_logging.disable_progress_bar()  # (its "Loading weights" bar would land in lmpm's output)
_net = GPT2LMHeadModel.from_pretrained(MODEL, local_files_only=True).eval()
_tokenizer = Tokenizer.from_file(str(MODEL / "tokenizer.json"))


@lmpm.bind("GPT")
def gpt(
    inputs: dict[str, torch.Tensor], *, vocab: int, k: int = 8, pick: str = "top", **_: Any
) -> dict[str, torch.Tensor]:
    """Each open cell's ``k`` most likely next tokens after its causal read ``context`` (greedy
    decoding with the runner-ups kept, so a constraint that rejects the favourite finds the best
    token it allows), scored by their log-probs."""
    if pick != "top":
        raise ValueError(f"GPT proposes its top-k tokens (pick='top'), not pick={pick!r}")
    ids, mask, index = inputs["context"], inputs["context_mask"], inputs["context_index"]
    net = _net.to(ids.device)  # the worker's device (a no-op once there)
    rows = []
    with torch.no_grad():
        for r in range(ids.shape[0]):  # the visible cells of the row, in sequence order
            seen = mask[r]
            prefix = ids[r][seen][index[r][seen].argsort()]
            if prefix.numel() == 0:  # nothing before the cell: start from end-of-text
                prefix = torch.tensor([net.config.bos_token_id], device=ids.device)
            logits = net(input_ids=prefix[None], use_cache=False).logits[0, -1, :vocab]
            rows.append(torch.log_softmax(logits.float(), dim=-1))
    logp = torch.stack(rows)  # (n, vocab)
    top = logp.topk(min(int(k), vocab), dim=-1)
    return {"proposal": top.indices, "score": top.values}


@lmpm.bind("Words")
def words(*banned: str) -> list[int]:
    """The ids of the tokens whose text contains one of ``banned`` (any case)."""
    wanted = [w.lower() for w in banned]
    return [
        i
        for i in range(_tokenizer.get_vocab_size())
        if any(w in _tokenizer.decode([i]).lower() for w in wanted)
    ]
