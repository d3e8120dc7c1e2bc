"""Command line: ``python -m minimax_jax <command>`` (also installed as ``minimax-jax``).

Commands:
  forward   load a checkpoint directory, run the plain causal forward on token ids and greedily extend them

Errors in what the user gave (a bad path, a malformed config or checkpoint, out-of-range token ids, wrong
arguments) print one line ``minimax-jax: error: ...`` and exit with status 2; ``--debug`` shows the traceback.
"""

from __future__ import annotations

import argparse
import sys
import time

PROG = "minimax-jax"


class UsageError(Exception):
    """A problem with what the user asked for, reported as one line."""


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"token ids must be integers separated by spaces or commas, got {text!r}")


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


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--debug", action="store_true", help="show the full traceback on errors")
    sub = ap.add_subparsers(dest="command", required=True)
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

    return (UsageError, ConfigError, CheckpointError, ValueError, FileNotFoundError, NotADirectoryError,
            PermissionError, IsADirectoryError)


def _show_warning(message, category, filename, lineno, file=None, line=None):
    print(f"{PROG}: warning: {message}", file=sys.stderr if file is None else file)


def main(argv: list[str] | None = None) -> int:
    import warnings

    ap = build_parser()
    args = ap.parse_args(argv)  # argparse itself prints one usage line and exits 2 on bad arguments
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
        msg = " ".join(str(e).split()) or type(e).__name__
        print(f"{PROG}: error: {msg}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
