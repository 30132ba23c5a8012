"""Train the bundled Hugging Face example's model: a byte-level BPE tokenizer and a small GPT-2.

The text is the one ByteLM learns from (scripts/train_text.py): captions of the generated world
(world seed 1; held out: world seed 2), about a third of the rows in sentence case
(``lmpm.models.training.text_corpus``). Deterministic (seeded; one CPU thread), a few minutes on a
2-core CPU. Writes OUT (default examples/hf/model/) as ``transformers`` saves a model and its
tokenizer (``config.json``, ``model.safetensors``, ``tokenizer.json``, ...), loadable offline with
``from_pretrained(OUT, local_files_only=True)``, and prints one JSON line with the metrics.

    python scripts/train_hf.py [--steps 400] [--vocab 1024] [--out examples/hf/model]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

from lmpm.models.training import HELDOUT_WORLD, TRAIN_WORLD, text_corpus

OUT = Path(__file__).resolve().parents[1] / "examples" / "hf" / "model"
EOS = "<|endoftext|>"
ROW_BYTES = 640  # bytes of text per corpus row (each starts at a caption)
BLOCK = 128  # tokens per training sequence
MODEL = {"n_layer": 2, "n_head": 4, "n_embd": 96, "n_positions": 256}


def rows(n: int, world: int) -> list[str]:
    """``n`` rows of captions, each cut after its last complete sentence."""
    out = []
    for r in text_corpus(n, world, length=ROW_BYTES).tolist():
        text = bytes(r).decode()
        out.append(text[: text.rfind(".") + 1])
    return out


def train_tokenizer(texts: list[str], vocab: int) -> Tokenizer:
    """GPT-2's scheme: byte-level pre-tokenization (every byte has a token), BPE merges on top."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        min_frequency=2,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return tok


def blocks(tok: Tokenizer, texts: list[str]) -> torch.Tensor:
    """(n, BLOCK) token rows: each text encoded and followed by EOS, all concatenated and cut."""
    eos = tok.token_to_id(EOS)
    ids: list[int] = []
    for enc in tok.encode_batch(texts):
        ids += [*enc.ids, eos]
    n = len(ids) // BLOCK
    return torch.tensor(ids[: n * BLOCK], dtype=torch.long).reshape(n, BLOCK)


def loss_of(model: GPT2LMHeadModel, x: torch.Tensor) -> float:
    with torch.no_grad():
        return float(model(input_ids=x, labels=x).loss)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--rows", type=int, default=4000, help="corpus rows (of ~640 bytes)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)  # the same floats on every machine, whatever its core count
    t0 = time.perf_counter()
    texts = rows(args.rows, TRAIN_WORLD)
    tok = train_tokenizer(texts, args.vocab)
    data = blocks(tok, texts)
    held = blocks(tok, rows(64, HELDOUT_WORLD))
    config = GPT2Config(
        vocab_size=tok.get_vocab_size(),
        bos_token_id=tok.token_to_id(EOS),
        eos_token_id=tok.token_to_id(EOS),
        **MODEL,
    )
    model = GPT2LMHeadModel(config)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    g = torch.Generator().manual_seed(args.seed)
    model.train()
    for step in range(args.steps):
        for group in opt.param_groups:  # cosine decay after a short warm-up
            warm = min(1.0, (step + 1) / 100)
            group["lr"] = args.lr * warm * 0.5 * (1 + math.cos(math.pi * step / args.steps))
        x = data[torch.randint(0, data.shape[0], (args.batch,), generator=g)]
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 100 == 0 or step == args.steps - 1:
            print(
                f"step {step}: loss {loss.item():.3f} ({time.perf_counter() - t0:.0f} s)",
                file=sys.stderr,
                flush=True,
            )
    model.eval()
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOS, eos_token=EOS)
    fast.save_pretrained(args.out)
    weights = args.out / "model.safetensors"
    metrics = {
        "model": "hf-gpt2",
        "params": sum(p.numel() for p in model.parameters()),
        "vocab": tok.get_vocab_size(),
        "train_tokens": data.numel(),
        "steps": args.steps,
        "train_loss": round(loss_of(model, data[:64]), 4),
        "heldout_loss": round(loss_of(model, held), 4),
        "seconds": round(time.perf_counter() - t0, 1),
        "bytes": weights.stat().st_size,
        "out": str(args.out),
    }
    print(json.dumps(metrics), flush=True)


if __name__ == "__main__":
    main()
