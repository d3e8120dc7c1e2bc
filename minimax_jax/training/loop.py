"""What both training scripts share: AdamW + warmup/cosine, f32 master weights with a compute-dtype cast,
resumable orbax checkpoints, the time budget and step planning, progress bar, metrics log and loss plot.

**Schedule.** ``lr(step)`` rises linearly over ``warmup`` steps to ``peak`` and follows a cosine down to
``final_ratio * peak`` at ``planned_steps``. The optimiser (``clip_by_global_norm`` -> ``scale_by_adam`` ->
decoupled weight decay on matrices) produces a direction; the step subtracts ``lr * direction`` with ``lr`` a
traced argument, so the schedule can be planned after the first steps without recompiling.

**Planning.** With ``planned_steps = None`` the loop times ``calibration_steps`` steps after compilation and
plans as many steps as fit before the deadline (``max_minutes`` minus a reserve for the final evaluation and
export), capped by ``max_steps``. The plan is stored in the checkpoint, so a resumed run keeps its schedule.

**Resuming.** :class:`Checkpointer` keeps the last two checkpoints (state pytree + a JSON ``meta``) in
``run_dir/ckpt``; a run restarts from the latest one. ``run_dir/metrics.jsonl`` is trimmed to the restored step.
The loop checkpoints every ``checkpoint_minutes`` and when it stops (plan finished or deadline reached).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

KEEP_FP32 = ("e_score_correction_bias",)


# ----------------------------------------------------------------------------------------------- optimiser
def lr_schedule(step: int, *, peak: float, warmup: int, total: int, final_ratio: float = 0.1) -> float:
    """Linear warmup to ``peak`` over ``warmup`` steps, then cosine to ``final_ratio * peak`` at ``total``."""
    if step < warmup:
        return peak * (step + 1) / max(1, warmup)
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    final = final_ratio * peak
    return final + (peak - final) * 0.5 * (1.0 + math.cos(math.pi * progress))


def make_optimizer(*, weight_decay: float, b1: float = 0.9, b2: float = 0.95, clip_norm: float = 1.0,
                   eps: float = 1e-8):
    """AdamW without its learning rate: ``params -= lr * update`` happens in the step (see the module doc).

    Weight decay applies to arrays with at least 2 dimensions (matrices, embeddings, experts), not to norms
    and biases.
    """
    import optax

    def decay_mask(params):
        return jax.tree.map(lambda p: p.ndim >= 2, params)

    return optax.chain(optax.clip_by_global_norm(clip_norm), optax.scale_by_adam(b1=b1, b2=b2, eps=eps),
                       optax.add_decayed_weights(weight_decay, mask=decay_mask))


def apply_updates(params, updates, lr):
    return jax.tree.map(lambda p, u: (p - lr * u).astype(p.dtype), params, updates)


def global_norm(tree) -> jax.Array:
    return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree)))


def cast_floats(tree, dtype, *, keep_fp32: tuple[str, ...] = KEEP_FP32):
    """Cast floating leaves to ``dtype`` (the compute copy of f32 master weights), except paths ending in
    ``keep_fp32`` names (the router's selection bias stays f32, as in the model)."""

    def cast(path, x):
        # an nnx.State path ends in the Variable's own attribute (e.g. GetAttrKey("value")): look at every entry
        names = {getattr(k, "key", getattr(k, "name", None)) for k in path}
        if names & set(keep_fp32) or not jnp.issubdtype(x.dtype, jnp.floating):
            return x
        return x.astype(dtype)

    return jax.tree_util.tree_map_with_path(cast, tree)


# ----------------------------------------------------------------------------------------------- checkpoints
class Checkpointer:
    """Resumable orbax checkpoints of a state pytree plus a JSON ``meta`` dict (keeps the last ``max_to_keep``)."""

    def __init__(self, directory: str | os.PathLike, *, max_to_keep: int = 2):
        import orbax.checkpoint as ocp

        self._ocp = ocp
        self.directory = os.path.abspath(os.fspath(directory))
        os.makedirs(self.directory, exist_ok=True)
        self.manager = ocp.CheckpointManager(
            self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True))

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state, meta: dict) -> None:
        """Save ``step``; a checkpoint of the same step (a timed save just before the final one, on a slow machine)
        is replaced, since the final save's metadata is newer."""
        ocp = self._ocp
        if int(step) in self.manager.all_steps():
            self.manager.delete(int(step))
        self.manager.save(int(step), args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                             meta=ocp.args.JsonSave(meta)), force=True)
        self.manager.wait_until_finished()

    def restore(self, abstract_state) -> tuple[Any, dict] | None:
        """``(state, meta)`` of the latest checkpoint (shaped like ``abstract_state``), or None."""
        step = self.latest_step()
        if step is None:
            return None
        ocp = self._ocp
        out = self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state),
                                                                 meta=ocp.args.JsonRestore()))
        return out.state, dict(out.meta)

    def close(self) -> None:
        self.manager.close()


def abstract_like(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), jnp.asarray(x).dtype)
                        if not isinstance(x, jax.ShapeDtypeStruct) else x, tree)


# ----------------------------------------------------------------------------------------------- metrics
class MetricsLog:
    """``metrics.jsonl`` in the run directory: one JSON object per logged step (and per evaluation)."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)

    def records(self) -> list[dict]:
        if not os.path.isfile(self.path):
            return []
        with open(self.path) as f:
            return [json.loads(line) for line in f if line.strip()]

    def trim(self, max_step: int) -> None:
        """Drop records after ``max_step`` (logged after the checkpoint a resumed run restarts from)."""
        kept = [r for r in self.records() if r.get("step", 0) <= max_step]
        with open(self.path, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in kept)

    def append(self, record: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")


def plot_curves(records: list[dict], path: str | os.PathLike, *, title: str,
                series: tuple[tuple[str, str], ...]) -> None:
    """Save a PNG: one panel per ``(key, label)`` in ``series``, x = step (records without the key skipped)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    present = [(k, label) for k, label in series if any(k in r for r in records)]
    if not present:
        return
    ncols = min(3, len(present))
    nrows = -(-len(present) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.5 * ncols, 3.2 * nrows), squeeze=False)
    for ax in axes.reshape(-1)[len(present):]:
        ax.set_visible(False)
    for ax, (key, label) in zip(axes.reshape(-1), present):
        pts = [(r["step"], r[key]) for r in records if key in r and r[key] is not None]
        xs, ys = zip(*pts)
        ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, markersize=3)
        ax.set_xlabel("step")
        ax.set_title(label)
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(os.fspath(path), dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------------------------- the loop
@dataclasses.dataclass
class LoopSettings:
    max_minutes: float  # wall-clock limit of this invocation (process start to exit)
    reserve_minutes: float  # kept free for the final evaluation / export
    planned_steps: int | None  # None: plan from the measured step time
    max_steps: int  # cap of the plan (e.g. a number of epochs)
    min_steps: int = 20
    calibration_steps: int = 10
    warmup: int | float = 0.04  # steps (int) or a fraction of the plan (float)
    peak_lr: float = 1e-3
    final_lr_ratio: float = 0.1
    log_every: int = 10
    eval_every: int = 0  # 0: about 8 evaluations over the plan
    checkpoint_minutes: float = 2.0
    expected_phases: int = 1  # step variants (compilations) the plan will meet, e.g. 2 with a dense warm-up
    stop_after: int | None = None  # at most this many steps in this invocation (then checkpoint and return)


class TrainLoop:
    """Runs ``step_fn`` from the restored step to the plan or the deadline, with checkpoints and evaluations.

    ``step_fn(state, step, lr, phase) -> (state, metrics)``: metrics is a dict of device scalars, fetched every
    ``log_every`` steps. ``eval_fn(state, step) -> dict`` (host numbers) runs every ``eval_every`` steps.
    ``phase_fn(step, planned) -> str`` names the step's variant (e.g. "dense" warm-up, "sparse"; ``planned`` is
    None until the plan is made): a variant seen for the first time compiles, and that step is not timed.
    """

    def __init__(self, settings: LoopSettings, *, run_dir: str, checkpointer: Checkpointer, metrics: MetricsLog,
                 start_time: float, desc: str):
        self.s = settings
        self.run_dir = run_dir
        self.ckpt = checkpointer
        self.metrics = metrics
        self.start_time = start_time
        self.desc = desc
        self.deadline = start_time + 60.0 * (settings.max_minutes - settings.reserve_minutes)

    def warmup_steps(self, planned: int) -> int:
        w = self.s.warmup
        return int(w) if isinstance(w, int) else max(1, round(w * planned))

    def lr(self, step: int, planned: int) -> float:
        return lr_schedule(step, peak=self.s.peak_lr, warmup=self.warmup_steps(planned), total=planned,
                           final_ratio=self.s.final_lr_ratio)

    def run(self, state, meta: dict, step_fn: Callable, *, eval_fn: Callable | None = None,
            phase_fn: Callable | None = None) -> tuple[Any, dict]:
        """Train; returns ``(state, meta)`` with ``meta["step"]``, ``meta["planned_steps"]``, ``meta["finished"]``."""
        from tqdm.auto import tqdm

        s = self.s
        step = int(meta.get("step", 0))
        planned = meta.get("planned_steps") or s.planned_steps
        # before the plan is measured, the schedule assumes the largest plan (a slower, safe warmup)
        provisional = planned or s.max_steps
        seen_phases: set[str] = set()
        timed, timed_s, last_ckpt, compile_s = 0, 0.0, time.time(), 0.0
        eval_every = s.eval_every or max(1, (planned or provisional) // 8)
        bar = tqdm(total=planned or provisional, initial=step, desc=self.desc, dynamic_ncols=True,
                   mininterval=5.0, disable=False)
        stop_reason = "plan finished"
        first_step = step
        if eval_fn is not None and step == 0:  # the starting point of the curve; compiles before the plan is timed
            self.metrics.append({"step": 0, "event": "eval", **eval_fn(state, 0)})
        while True:
            limit = planned or provisional
            if step >= limit and planned is not None:
                break
            if time.time() >= self.deadline:
                stop_reason = "time limit"
                break
            if s.stop_after is not None and step - first_step >= s.stop_after:
                stop_reason = "stop-after"
                break
            phase = phase_fn(step, planned) if phase_fn is not None else "train"
            t0 = time.time()
            lr = self.lr(step, limit)
            state, m = step_fn(state, step, lr, phase)
            step += 1
            if planned is None:
                jax.block_until_ready(m)
                if phase in seen_phases:
                    timed += 1
                    timed_s += time.time() - t0
                else:
                    compile_s = max(compile_s, time.time() - t0)
            seen_phases.add(phase)
            bar.update(1)
            if planned is None and timed >= s.calibration_steps:
                per_step = timed_s / timed
                # later variants compile too: keep about one first-step time free for each
                left = self.deadline - time.time() - compile_s * max(0, s.expected_phases - len(seen_phases))
                planned = int(min(s.max_steps, max(s.min_steps, step + 0.92 * left / per_step)))
                planned = max(planned, step + 1)
                eval_every = s.eval_every or max(1, planned // 8)
                bar.total = planned
                bar.refresh()
                self.metrics.append({"step": step, "event": "plan", "planned_steps": planned,
                                     "seconds_per_step": per_step})
                tqdm.write(f"{self.desc}: {per_step * 1e3:.1f} ms/step -> planned {planned} steps "
                           f"(cap {s.max_steps})")
            if step % s.log_every == 0 or step == 1:
                host = {k: float(v) for k, v in jax.device_get(m).items()}
                rec = {"step": step, "lr": lr, "time": time.time() - self.start_time, **host}
                self.metrics.append(rec)
                bar.set_postfix({k: f"{v:.3g}" for k, v in list(host.items())[:4]}, refresh=False)
            if eval_fn is not None and step % eval_every == 0:
                self.metrics.append({"step": step, "event": "eval", **eval_fn(state, step)})
            if time.time() - last_ckpt > 60.0 * s.checkpoint_minutes:
                self.save(state, meta, step, planned)
                last_ckpt = time.time()
        bar.close()
        meta = self.save(state, meta, step, planned or step)
        meta["finished"] = planned is not None and step >= planned
        meta["stop_reason"] = stop_reason
        return state, meta

    def save(self, state, meta: dict, step: int, planned: int | None) -> dict:
        meta = {**meta, "step": int(step), "planned_steps": None if planned is None else int(planned)}
        self.ckpt.save(step, state, meta)
        return meta
