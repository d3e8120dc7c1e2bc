"""Command line: ``python -m minimax_jax <command>`` (also installed as ``minimax-jax``).

Commands:
  forward   load a checkpoint directory, run the plain causal forward on token ids and greedily extend them
"""

from __future__ import annotations

import argparse
import os
import sys
import time

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_FIXTURE = os.path.join(_REPO, "tests", "fixtures", "hf_tiny")


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"token ids must be integers separated by spaces or commas, got {text!r}")


def cmd_forward(args) -> int:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from minimax_jax.checkpoint import load_model

    dtype = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[args.dtype]
    t0 = time.perf_counter()
    model = load_model(args.model, dtype=dtype)
    cfg = model.cfg
    print(f"loaded {args.model}: {cfg.num_hidden_layers} layers ({len(cfg.sparse_layer_ids)} MSA sparse, "
          f"{len(cfg.moe_layer_ids)} MoE), vocab {cfg.vocab_size}, {args.dtype}, {time.perf_counter() - t0:.2f}s")
    ids = list(args.ids)
    forward = jax.jit(lambda m, x: m(x))
    for _ in range(args.max_new_tokens):
        logits = forward(model, jnp.asarray([ids], jnp.int32))
        ids.append(int(jnp.argmax(logits[0, -1])))
    logits = np.asarray(forward(model, jnp.asarray([ids], jnp.int32)))
    print(f"prompt ids     : {list(args.ids)}")
    print(f"greedy new ids : {ids[len(args.ids):]}")
    print(f"logits         : shape {logits.shape}, mean {logits.mean():+.4f}, std {logits.std():.4f}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="minimax-jax", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    f = sub.add_parser("forward", help="plain causal forward + greedy extension of token ids")
    f.add_argument("--model", default=DEFAULT_FIXTURE, help="checkpoint directory (config.json + safetensors)")
    f.add_argument("--ids", type=_parse_ids, default=_parse_ids("1 17 42 99 3 250 8 64"),
                   help="prompt token ids, e.g. '1 17 42'")
    f.add_argument("--max-new-tokens", type=int, default=8)
    f.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    f.set_defaults(func=cmd_forward)
    args = ap.parse_args(argv)
    if getattr(args, "max_new_tokens", 0) < 0:
        ap.error("--max-new-tokens must be >= 0")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
