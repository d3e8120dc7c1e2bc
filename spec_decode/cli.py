"""Command line: ``minimax-jax <command>`` (also ``python -m spec_decode <command>``).

Commands:
  generate  speculative generation (DSpark drafter, adaptive verification) on the embedded default or a checkpoint
  forward   load a checkpoint directory, run the plain causal forward on token ids and greedily extend them

Errors in what the user gave (a bad path, a malformed config or checkpoint, out-of-range token ids, wrong
arguments or settings, argparse's own included) print one line ``minimax-jax: error: ...`` to stderr and exit
with status 2. Settings are checked before any model is loaded, the prompt before it is printed; ``--debug``
shows the traceback.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

PROG = "minimax-jax"


class UsageError(Exception):
    """A problem with what the user asked for, reported as one line."""


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


class ArgumentParser(argparse.ArgumentParser):
    """argparse, with every argument error as one line ``minimax-jax: error: ...`` and exit status 2."""

    def error(self, message):
        self.exit(2, f"{PROG}: error: {_one_line(message)}\n")


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"token ids must be integers separated by spaces or commas, got {text!r}") from None


def _non_negative(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {v}")
    return v


def cmd_forward(args) -> int:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from minimax_jax.checkpoint import load_model
    from minimax_jax.model import check_input_ids

    dtype = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[args.dtype]
    t0 = time.perf_counter()
    model = load_model(args.model, dtype=dtype)
    cfg = model.cfg
    if args.max_new_tokens >= cfg.max_position_embeddings:
        raise UsageError(f"--max-new-tokens {args.max_new_tokens} leaves no room for a prompt in the model's "
                         f"{cfg.max_position_embeddings} positions")
    # Validate on the host: inside the jitted forward the ids are tracers and cannot be checked.
    check_input_ids([args.ids], cfg.vocab_size, name="--ids",
                    max_length=cfg.max_position_embeddings - args.max_new_tokens)
    print(f"loaded {args.model}: {cfg.num_hidden_layers} layers ({len(cfg.sparse_layer_ids)} MSA sparse, "
          f"{len(cfg.moe_layer_ids)} MoE), vocab {cfg.vocab_size}, {args.dtype}, {time.perf_counter() - t0:.2f}s")
    ids = list(args.ids)
    forward = jax.jit(lambda m, x: m(x))
    for _ in range(args.max_new_tokens):
        logits = forward(model, jnp.asarray([ids], jnp.int32))
        ids.append(int(jnp.argmax(logits[0, -1])))
    logits = np.asarray(forward(model, jnp.asarray([ids], jnp.int32)))
    if not np.isfinite(logits).all():
        raise UsageError("the forward pass produced non-finite logits (a corrupt checkpoint?)")
    print(f"prompt ids     : {list(args.ids)}")
    print(f"greedy new ids : {ids[len(args.ids):]}")
    print(f"logits         : shape {logits.shape}, mean {logits.mean():+.4f}, std {logits.std():.4f}")
    return 0


# Ends mid-line: the BPE merges a newline with the indentation after it, so a prompt ending in "\n" asks the model
# to continue from a token boundary it rarely saw in training.
DEFAULT_PROMPT = "import codecs\n\n\nclass Codec(codecs.Codec):\n\n    def encode(self, input, errors='strict'):"


def _load_pair(args, dtype):
    """(target, drafter or None, tokenizer or None) from --model/--drafter/--tokenizer, else the embedded default."""
    import os

    from minimax_jax.checkpoint import load_model
    from minimax_jax.drafter_checkpoint import load_drafter
    from minimax_jax.tokenizer import load_tokenizer

    if args.model is None:
        if args.drafter is not None:
            raise UsageError("--drafter needs --model (the target it was trained for)")
        from minimax_jax.default import load_default

        target, drafter, tokenizer = load_default(dtype=dtype)
        if args.tokenizer is not None:
            tokenizer = load_tokenizer(args.tokenizer)
        return target, drafter, tokenizer
    target = load_model(args.model, dtype=dtype)
    drafter = load_drafter(args.drafter, target, dtype=dtype) if args.drafter is not None else None
    tok_path = args.tokenizer
    if tok_path is None and os.path.isfile(os.path.join(args.model, "tokenizer.json")):
        tok_path = args.model
    return target, drafter, (load_tokenizer(tok_path) if tok_path is not None else None)


def _check_generate_args(args) -> dict:
    """The sampling keywords of ``generate``, validated (SamplingParams' rules) before anything is loaded."""
    from spec_decode.sampling_params import SamplingParams

    if args.prompt is not None and args.ids is not None:
        raise UsageError("give the prompt as text or with --ids, not both")
    if args.prompt == "":
        raise UsageError("the prompt is empty: a prompt needs at least one token")
    if args.ids is not None and not args.ids:
        raise UsageError("--ids is empty: a prompt needs at least one token")
    if args.verification != "none" and args.k < 1:
        raise UsageError(f"--k must be >= 1 (drafts per step), got {args.k}")
    if args.max_model_len < 2:
        raise UsageError(f"--max-model-len must be >= 2, got {args.max_model_len}")
    kw = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "top_p": args.top_p,
          "top_k": args.top_k, "seed": args.seed, "ignore_eos": args.ignore_eos, "min_p": args.min_p,
          "repetition_penalty": args.repetition_penalty, "presence_penalty": args.presence_penalty,
          "frequency_penalty": args.frequency_penalty, "min_tokens": args.min_tokens}
    if args.stop:
        kw["stop"] = list(args.stop)
    names = {"max_new_tokens": "--max-new-tokens", "temperature": "--temperature", "top_p": "--top-p",
             "top_k": "--top-k", "seed": "--seed", "min_p": "--min-p", "repetition_penalty": "--repetition-penalty",
             "presence_penalty": "--presence-penalty", "frequency_penalty": "--frequency-penalty",
             "min_tokens": "--min-tokens", "stop": "--stop"}
    try:
        SamplingParams(**kw)
    except ValueError as e:
        msg = str(e)
        for field, flag in names.items():
            if msg.startswith(field + " "):
                msg = flag + msg[len(field):]
        raise UsageError(msg) from None
    if args.stream and args.loop == "device":
        raise UsageError("--stream needs --loop host (the device loop returns when the whole batch is done)")
    return kw


def cmd_generate(args) -> int:
    kw = _check_generate_args(args)

    import jax
    import jax.numpy as jnp

    from spec_decode import Engine, SamplingParams
    from spec_decode.request import build_requests

    if args.dtype == "auto":
        dtype = jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    else:
        dtype = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[args.dtype]
    t0 = time.perf_counter()
    target, drafter, tokenizer = _load_pair(args, dtype)
    if drafter is None and args.verification != "none":
        raise UsageError(f"--verification {args.verification} needs a drafter: pass --drafter DIR (or use "
                         f"--verification none)")
    if args.ids is not None:
        prompt = args.ids
    else:
        if tokenizer is None:
            raise UsageError("no tokenizer for a text prompt: pass --tokenizer DIR, or token ids with --ids")
        prompt = args.prompt if args.prompt is not None else DEFAULT_PROMPT
    # one request: prefill chunks of up to 128 tokens and the host loop's programs only (unless --loop device)
    # keep the closed program set small (on a CPU: about 40 s to compile, then seconds from the compilation cache)
    engine = Engine(target, drafter, num_speculative_tokens=args.k, verification=args.verification,
                    max_num_seqs=1, max_model_len=args.max_model_len, tokenizer=tokenizer,
                    max_num_batched_tokens=128, device_loop=args.loop == "device",
                    # one prompt, its settings known: greedy without penalties needs half the programs
                    sampling=SamplingParams(**kw).needs_sampling_program)
    load_s = time.perf_counter() - t0
    # the prompt itself (ids in the vocabulary, its length against --max-model-len) before anything is printed
    build_requests([prompt], tokenizer=tokenizer, vocab_size=target.cfg.vocab_size,
                   eos_token_ids=target.cfg.eos_token_id, max_model_len=engine.max_model_len,
                   max_stop_ids=engine.num_stop_ids, keywords=kw, sampling_params=None)
    engine.warmup()  # its one line on stderr comes before the completion, not in the middle of it
    if isinstance(prompt, str):
        print(prompt, end="", flush=True)
    if args.stream:
        tokens: list[int] = []
        shown = ""
        for _, new in engine.stream([prompt], **kw):
            tokens.extend(new)
            if tokenizer is not None:
                text = tokenizer.decode(tokens)
                print(text[len(shown):], end="", flush=True)
                shown = text
            else:
                print(" ".join(map(str, new)), end=" ", flush=True)
        print()
        return 0
    res = engine.generate([prompt], **kw, loop=args.loop, progress=False)
    r = res[0]
    print(r.text if r.text is not None else " ".join(map(str, r.token_ids)))
    st, rs = r.stats, res.stats
    k = engine.k
    print("-" * 80)
    print(f"verification {engine.mode}, K = {k}, kernels {engine.implementation}, {args.loop} loop, loaded in "
          f"{load_s:.1f}s")
    print(f"{st['emitted_tokens']} tokens in {rs['wall_time_s']:.2f}s ({rs['output_tokens_per_s']:.1f} tokens/s, "
          f"compiles included: {rs['compiles']}), finish: {st['finish_reason']}")
    if k:
        per_pos = ", ".join("-" if math.isnan(v) else f"{v:.2f}" for v in rs["per_position_acceptance"])
        print(f"{st['target_steps']} verify steps, acceptance length {st['acceptance_length']:.2f} "
              f"(bonus included), verified drafts per step {rs['mean_verified_drafts_per_step']:.2f}")
        print(f"acceptance per position: {per_pos}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--debug", action="store_true", help="show the full traceback on errors")
    sub = ap.add_subparsers(dest="command", required=True, parser_class=ArgumentParser, metavar="{generate,forward}")
    g = sub.add_parser("generate", help="speculative generation on the embedded default (or --model/--drafter)")
    g.add_argument("prompt", nargs="?", default=None, help="the prompt text (default: a short code prompt)")
    g.add_argument("--ids", type=_parse_ids, default=None, help="the prompt as token ids instead of text")
    g.add_argument("--verification", choices=["adaptive", "fixed", "none"], default="adaptive")
    g.add_argument("--k", type=int, default=7, help="drafts per step (1..the drafter's block size)")
    g.add_argument("--max-new-tokens", type=int, default=96)
    g.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0, help="0: off")
    g.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="> 0, 1: off (vLLM's: divides the logits of tokens already in the prompt or the output)")
    g.add_argument("--presence-penalty", type=float, default=0.0, help=">= 0, 0: off")
    g.add_argument("--frequency-penalty", type=float, default=0.0, help=">= 0, 0: off")
    g.add_argument("--min-tokens", type=int, default=0, help="no EOS (or stop) before this many tokens")
    g.add_argument("--stop", action="append", default=None, metavar="TEXT",
                   help="stop when the text contains TEXT (cut before it); repeat for several")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--stream", action="store_true", help="print tokens as steps complete")
    g.add_argument("--loop", choices=["host", "device"], default="host",
                   help="host: the continuous-batching engine; device: the whole loop in one jitted program")
    g.add_argument("--model", default=None, help="target checkpoint directory (default: the embedded default)")
    g.add_argument("--drafter", default=None, help="DSpark drafter directory for --model")
    g.add_argument("--tokenizer", default=None, help="tokenizer.json or its directory (default: the model's)")
    g.add_argument("--max-model-len", type=int, default=1024)
    g.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                   help="auto: float32 on CPU, bfloat16 on GPUs")
    g.set_defaults(func=cmd_generate)
    f = sub.add_parser("forward", help="plain causal forward + greedy extension of token ids")
    f.add_argument("--model", required=True, help="checkpoint directory (config.json + safetensors)")
    f.add_argument("--ids", type=_parse_ids, default=_parse_ids("1 17 42 99 3 250 8 64"),
                   help="prompt token ids, e.g. '1 17 42'")
    f.add_argument("--max-new-tokens", type=_non_negative, default=8)
    f.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    f.set_defaults(func=cmd_forward)
    return ap


def _user_errors() -> tuple[type[BaseException], ...]:
    from minimax_jax.checkpoint import CheckpointError
    from minimax_jax.config import ConfigError
    from minimax_jax.default import DefaultModelMissing

    # OverflowError / TypeError: a user value no named check caught (a huge number, say) still ends as one line
    return (UsageError, ConfigError, CheckpointError, DefaultModelMissing, ValueError, FileNotFoundError,
            NotADirectoryError, PermissionError, IsADirectoryError, OverflowError, TypeError)


def _show_warning(message, category, filename, lineno, file=None, line=None):
    print(f"{PROG}: warning: {message}", file=sys.stderr if file is None else file)


def main(argv: list[str] | None = None) -> int:
    import warnings

    ap = build_parser()
    args = ap.parse_args(argv)  # bad arguments: one line and SystemExit(2) (ArgumentParser.error)
    if not args.debug:
        warnings.showwarning = _show_warning
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if args.debug or not isinstance(e, _user_errors()):
            raise
        msg = _one_line(e) or type(e).__name__
        print(f"{PROG}: error: {msg}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
