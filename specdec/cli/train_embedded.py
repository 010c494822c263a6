"""`specdec train-embedded`: train the embedded default model (or a small Qwen3.5 with an MTP layer) on the
CPython standard library, or dump its training text (see `specdec.train_embedded`)."""

from __future__ import annotations

import argparse

NAME = "train-embedded"
HELP = "train the embedded default model on the Python stdlib"
DESCRIPTION = ("Train the embedded default model: a small Kimi-Linear (KDA + MLA, 3:1) on the CPython standard "
               "library; --family qwen3_5 trains a small Qwen3.5 with one fresh MTP layer (drafter='native').")

# `specdec.train_embedded.FAMILIES` (importing it loads torch, which `specdec --help` does without);
# tests/test_cli.py checks that the two agree
FAMILIES = ("kimi_linear", "qwen3_5")


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from specdec import train_embedded

    if args.dump_corpus:
        train_embedded.dump_corpus(args.dump_corpus, args.corpus_mb)
        return 0
    train_embedded.train(out=args.out, prompts=args.prompts, minutes=args.minutes, vocab_size=args.vocab_size,
                         seq_len=args.seq_len, batch_size=args.batch_size, lr=args.lr, val_every=args.val_every,
                         seed=args.seed, threads=args.threads, family=args.family, tokenizer=args.tokenizer,
                         checkpoint=args.checkpoint)
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default=None, metavar="DIR",
                   help="where the model is saved (default: the package's embedded/)")
    p.add_argument("--prompts", default="bench/data/prompts.jsonl",
                   help="where the held-out benchmark prompts are written ('' for nowhere)")
    p.add_argument("--minutes", type=float, default=45.0, help="training time budget")
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--val-every", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)")
    p.add_argument("--family", choices=FAMILIES, default="kimi_linear", help="the model to train (see above)")
    p.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="use this directory's tokenizer (default: train one)")
    p.add_argument("--checkpoint", default=None, metavar="FILE", help="resumable training state (resumed if present)")
    p.add_argument("--dump-corpus", metavar="FILE", default=None,
                   help="write the training text (the drafters' distillation data) to FILE and exit")
    p.add_argument("--corpus-mb", type=float, default=2.0, help="with --dump-corpus: megabytes of text to write")
