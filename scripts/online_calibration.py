"""How the confidences the planner reads compare with what is accepted, call after call, with and without the
engine's online recalibration (``Engine(confidence="calibrated")``, docs/ADAPTIVE_VERIFICATION.md).

    PYTHONPATH=. python3 scripts/online_calibration.py --out calibration_online.json          # CPU is fine
    PYTHONPATH=. python3 scripts/online_calibration.py --out f.json --requests 64 --calls 4 --dtype bfloat16

The embedded default, **fixed** K (every draft verified, so both engines verify the same positions and emit the
same greedy tokens: the comparison isolates the confidences), greedy, EOS ignored, device loop. Each call decodes
``--requests`` held-out prompts it has not seen (``scripts/workloads.py``, windows from offset 1000 on, other
windows each call); the same calls run on an engine with the drafter's head (``confidence="head"``: its STS
temperatures, fixed) and on one that recalibrates it online (``"calibrated"``: a per-position Platt fit on the
verified positions, refit as it goes, kept across calls). Per call: the observed survival per position (the first
``k`` drafts all accepted, at the verified positions), the predicted survival the plan would have read, and their
calibration error (``results.stats``). Calibration does not depend on the device, so a CPU run answers it; the
speed of either setting is ``scripts/bench_e2e.py``'s question (mode ``adaptive-calibrated``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="JSON file for the per-call rows")
    ap.add_argument("--requests", type=int, default=32, help="prompts per call (also the engine's slots)")
    ap.add_argument("--calls", type=int, default=3)
    ap.add_argument("--k", type=int, default=7, help="fixed K")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--offset", type=int, default=1000, help="held-out windows skipped before the first call's")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp

    from minimax_jax.default import load_default
    from scripts.workloads import heldout_windows
    from spec_decode import Engine

    target, drafter, tok = load_default(dtype=getattr(jnp, args.dtype))
    rows = []
    for confidence in ("calibrated", "head"):
        eng = Engine(target, drafter, num_speculative_tokens=args.k, verification="fixed", confidence=confidence,
                     max_num_seqs=args.requests, max_num_batched_tokens=512, sampling=False, cost_table=None,
                     tokenizer=tok)
        for call in range(args.calls):
            prompts = heldout_windows(tok, args.requests, args.prompt_len, offset=args.offset + args.requests * call)
            t0 = time.perf_counter()
            res = eng.generate(prompts, max_new_tokens=args.max_new_tokens, ignore_eos=True, loop="device",
                               progress=False)
            st = res.stats
            rows.append({"confidence": confidence, "call": call, "seconds": round(time.perf_counter() - t0, 2),
                         "acceptance_length": st["mean_acceptance_length"],
                         "calibration_error": st["calibration_error"],
                         "observed": st["per_position_acceptance"],
                         "predicted": st["predicted_per_position_acceptance"]})
            print(f"online_calibration: {confidence} call {call}: calibration error "
                  f"{st['calibration_error']:.4f}; observed "
                  f"{[round(x, 3) for x in st['per_position_acceptance']]}, predicted "
                  f"{[round(x, 3) for x in st['predicted_per_position_acceptance']]}", flush=True)
        del eng
    meta = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__, "date": time.strftime("%Y-%m-%d"),
            "argv": sys.argv[1:], **vars(args)}
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
