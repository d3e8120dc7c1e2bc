"""Safetensors checkpoints read through a weight plan: one matching routine for the target and the drafter.

A *weight plan* maps every NNX parameter path to the checkpoint tensors it is built from, per naming scheme:
``{path: {scheme: Source(names, shapes, combine)}}`` (:func:`minimax_jax.checkpoint.weight_plan`,
:func:`minimax_jax.drafter_checkpoint.drafter_weight_plan`). :func:`load_weights` matches a plan against a
:class:`SafetensorsReader` and fills an abstract NNX state; every missing, unexpected, mis-shaped and wrongly typed
tensor is collected into one :class:`CheckpointError`. Tensors are read one at a time, so a checkpoint is never
held in memory as a whole. The layout transforms (:func:`identity`, :func:`transpose`, :func:`concat_transpose`)
have inverses (:func:`to_checkpoint_tensors`) for writing checkpoints.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import struct
from collections.abc import Callable, Iterator, Mapping

import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import SafetensorError, safe_open

Rename = Mapping[str, str] | Callable[[str], str] | None
WeightPlan = Mapping[tuple, Mapping[str, "Source"]]

# Tensor names of quantised releases (scales beside the weights): read only with a quantization_config.
_QUANTISED = re.compile(r"\.(weight_scale_inv|weight_scale|scales?)$")
# safetensors dtypes numpy has no name for: read through a memory map of the file and ml_dtypes
_ML_DTYPES = {"F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}
# safetensors header dtypes -> numpy names (for messages)
_DTYPE_NAMES = {
    "BOOL": "bool", "U8": "uint8", "I8": "int8", "U16": "uint16", "I16": "int16", "U32": "uint32", "I32": "int32",
    "U64": "uint64", "I64": "int64", "F16": "float16", "BF16": "bfloat16", "F32": "float32", "F64": "float64",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
}


class CheckpointError(ValueError):
    """A checkpoint that does not fit the model, or cannot be read: the message names the file or tensors."""


# ----------------------------------------------------------------------------------------------- plan vocabulary
@dataclasses.dataclass(frozen=True)
class Source:
    """How one model parameter is built from checkpoint tensors in one naming scheme."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    combine: Callable[[list[np.ndarray]], np.ndarray]


def identity(xs: list[np.ndarray]) -> np.ndarray:
    """One tensor, as stored."""
    return xs[0]


def transpose(xs: list[np.ndarray]) -> np.ndarray:
    """A torch Linear weight ``[out, in]`` -> kernel ``[in, out]``."""
    return xs[0].T


def concat_transpose(xs: list[np.ndarray]) -> np.ndarray:
    """Torch Linear weights ``[out_i, in]`` concatenated along ``out`` (e.g. ``[gate; up]``) -> ``[in, sum out_i]``."""
    return np.concatenate(xs, axis=0).T


def concat_rows(xs: list[np.ndarray]) -> np.ndarray:
    """Tensors ``[rows_i, cols]`` concatenated along the rows, no transpose (e.g. MX weights ``[gate; up]`` kept
    in the checkpoint's ``[out, in]`` layout)."""
    return np.concatenate(xs, axis=0)


def experts_transpose(xs: list[np.ndarray]) -> np.ndarray:
    """Stacked expert weights ``[E, out, in]`` (HF) -> ``[E, in, out]``."""
    return np.swapaxes(xs[0], 1, 2)


def _span(sl: slice, n: int) -> tuple[int, int]:
    start, stop, step = sl.indices(n)
    if step != 1:
        raise ValueError(f"only unit-step slices are read, got {sl}")
    return start, stop


def rows_of_parts(sizes, lo: int, hi: int):
    """``[(part, start, stop)]``: the pieces of rows ``[lo, hi)`` of parts of ``sizes`` rows concatenated."""
    out, base = [], 0
    for i, n in enumerate(sizes):
        a, b = max(lo, base), min(hi, base + n)
        if a < b:
            out.append((i, a - base, b - base))
        base += n
    return out


def read_block(src: Source, read_slice, index: tuple[slice, ...], shape: tuple[int, ...]) -> np.ndarray:
    """``src.combine(tensors)[index]`` (``shape``: the combined array's), reading only the checkpoint slices it
    needs through ``read_slice(name, slices)``: the sharded loader's path (docs/PARALLELISM.md)."""
    spans = [_span(sl, n) for sl, n in zip(index, shape)]
    block = getattr(src.combine, "block", None)
    if block is not None:
        return block(src, read_slice, spans)
    if src.combine is identity:
        return read_slice(src.names[0], tuple(slice(a, b) for a, b in spans))
    if src.combine is transpose:
        (r0, r1), (c0, c1) = spans
        return read_slice(src.names[0], (slice(c0, c1), slice(r0, r1))).T
    if src.combine is experts_transpose:
        (e0, e1), (i0, i1), (o0, o1) = spans
        return np.swapaxes(read_slice(src.names[0], (slice(e0, e1), slice(o0, o1), slice(i0, i1))), 1, 2)
    if src.combine is concat_transpose:
        (r0, r1), (c0, c1) = spans
        parts = [read_slice(src.names[i], (slice(a, b), slice(r0, r1)))
                 for i, a, b in rows_of_parts([s[0] for s in src.shapes], c0, c1)]
        return np.concatenate(parts, axis=0).T
    if src.combine is concat_rows:
        (r0, r1), (c0, c1) = spans
        parts = [read_slice(src.names[i], (slice(a, b), slice(c0, c1)))
                 for i, a, b in rows_of_parts([s[0] for s in src.shapes], r0, r1)]
        return np.concatenate(parts, axis=0)
    raise CheckpointError(f"internal: no sliced reader for the transform of {src.names}")


def to_checkpoint_tensors(src: Source, arr: np.ndarray) -> list[np.ndarray]:
    """Inverse of ``src.combine`` for the transforms above: one JAX-layout array -> the tensors of ``src.names``
    (shape-checked against ``src.shapes``)."""
    if src.combine is identity:
        parts = [arr]
    elif src.combine is transpose:
        parts = [arr.T]
    elif src.combine is experts_transpose:
        parts = [np.swapaxes(arr, 1, 2)]
    elif src.combine is concat_transpose:
        cuts = np.cumsum([s[0] for s in src.shapes])[:-1]
        parts = np.split(arr.T, cuts, axis=0)
    elif src.combine is concat_rows:
        parts = np.split(arr, np.cumsum([s[0] for s in src.shapes])[:-1], axis=0)
    else:
        raise CheckpointError(f"internal: no inverse for the transform of {src.names}")
    parts = [np.ascontiguousarray(p) for p in parts]
    for name, part, shape in zip(src.names, parts, src.shapes):
        if part.shape != tuple(shape):
            raise CheckpointError(f"internal: {name} has shape {part.shape}, expected {tuple(shape)}")
    return parts


def compose_rename(user: Rename, canonical: Callable[[str], str]) -> Callable[[str], str]:
    """Checkpoint name -> matching name: the caller's table or function first (if any), then ``canonical``."""
    def rename(raw: str) -> str:
        name = raw
        if user is not None:
            name = user(name) if callable(user) else user.get(name, name)
        return canonical(name)
    return rename


# ----------------------------------------------------------------------------------------------- reading
def checkpoint_directory(path: str | os.PathLike, *, kind: str = "model") -> str:
    """``path`` as a string if it is a directory; a clear error for a file or a path that does not exist."""
    path = os.fspath(path)
    if os.path.isdir(path):
        return path
    if os.path.exists(path):
        raise NotADirectoryError(f"expected a {kind} checkpoint directory with config.json and *.safetensors, got "
                                 f"the file {path}; pass its directory {os.path.dirname(os.path.abspath(path))}")
    raise FileNotFoundError(f"no {kind} checkpoint at {path}: the path does not exist")


class SafetensorsReader:
    """Name -> file index over a ``.safetensors`` file, a directory of them, or a sharded
    ``model.safetensors.index.json``; shapes and dtypes come from the file headers, tensors are read one at a time.

    ``names`` maps each matching name (``rename(raw)``) to the raw checkpoint name. A file that cannot be parsed
    raises a :class:`CheckpointError` naming it.
    """

    def __init__(self, path: str | os.PathLike, *, rename: Callable[[str], str] | None = None):
        path = os.fspath(path)
        self.path = path
        self._headers: dict[tuple[str, str], tuple[tuple[int, ...], str]] = {}  # (file, raw) -> (shape, dtype)
        files: dict[str, str] = {}
        if os.path.isdir(path):
            index = os.path.join(path, "model.safetensors.index.json")
            if os.path.isfile(index):
                with open(index) as f:
                    try:
                        weight_map = json.load(f).get("weight_map")
                    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as e:
                        raise CheckpointError(f"{index} is not a JSON object ({e})") from None
                if not isinstance(weight_map, dict):
                    raise CheckpointError(f"{index} has no 'weight_map' object")
                for name, fname in weight_map.items():
                    files[name] = os.path.join(path, fname)
                missing_files = sorted({f for f in files.values() if not os.path.isfile(f)})
                if missing_files:
                    raise CheckpointError(f"{index} names shard files that do not exist: {missing_files}")
                self._check_index(index, files)
            else:
                candidates = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
                if not candidates:
                    raise FileNotFoundError(f"no .safetensors file or model.safetensors.index.json in {path}")
                for fname in candidates:
                    full = os.path.join(path, fname)
                    for name in self._read_header(full):
                        files[name] = full
        elif os.path.isfile(path):
            if not path.endswith(".safetensors"):
                raise CheckpointError(f"expected a .safetensors file or a checkpoint directory, got {path}")
            files = dict.fromkeys(self._read_header(path), path)
        else:
            raise FileNotFoundError(f"no checkpoint at {path}: the path does not exist")
        self.raw_files = files
        self.names: dict[str, str] = {(rename(raw) if rename is not None else raw): raw for raw in files}

    @contextlib.contextmanager
    def _open(self, file: str) -> Iterator:
        try:
            with safe_open(file, framework="np") as f:
                yield f
        except SafetensorError as e:
            raise CheckpointError(f"cannot read the safetensors file {file}: it looks truncated or corrupt "
                                  f"({e})") from None

    def _read_header(self, file: str) -> list[str]:
        """The tensor names of ``file``; caches their shapes and dtypes."""
        with self._open(file) as f:
            names = list(f.keys())
            for name in names:
                sl = f.get_slice(name)
                self._headers[file, name] = (tuple(sl.get_shape()), sl.get_dtype())
        return names

    def _check_index(self, index: str, files: Mapping[str, str]) -> None:
        """Every shard's header read once (headers only): a tensor the index places in a shard that lacks it, or
        a shard holding a tensor the index places elsewhere or omits, is one error naming the files."""
        held: dict[str, set[str]] = {f: set(self._read_header(f)) for f in sorted(set(files.values()))}
        problems = []
        for f, names in held.items():
            absent = sorted(n for n, g in files.items() if g == f and n not in names)
            if absent:
                problems.append(f"{os.path.basename(f)} lacks {len(absent)} tensor(s) the index places in it: "
                                + ", ".join(absent[:8]) + (" ..." if len(absent) > 8 else ""))
            stray = sorted(n for n in names if files.get(n) != f)
            if stray:
                where = ", ".join(f"{n} (index: {os.path.basename(files[n]) if n in files else 'not listed'})"
                                  for n in stray[:8])
                problems.append(f"{os.path.basename(f)} holds {len(stray)} tensor(s) the index does not place in it: "
                                + where + (" ..." if len(stray) > 8 else ""))
        if problems:
            raise CheckpointError(f"{index} disagrees with its shards:\n  " + "\n  ".join(problems))

    def _memmap(self, name: str) -> np.ndarray:
        """A read-only memory map of a tensor whose dtype numpy lacks (float8): its bytes, from the file header."""
        import ml_dtypes

        raw = self.names[name]
        file = self.raw_files[raw]
        with open(file, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        info = header[raw]
        start, stop = info["data_offsets"]
        dtype = np.dtype(getattr(ml_dtypes, _ML_DTYPES[info["dtype"]]))
        flat = np.memmap(file, dtype=np.uint8, mode="r", offset=8 + n + start, shape=(stop - start,))
        return flat.view(dtype).reshape(tuple(info["shape"]))

    def _header(self, name: str) -> tuple[tuple[int, ...], str]:
        raw = self.names[name]
        key = (self.raw_files[raw], raw)
        if key not in self._headers:
            self._read_header(key[0])
            if key not in self._headers:
                raise CheckpointError(f"the index of {self.path} places {raw} in {key[0]}, which does not hold it")
        return self._headers[key]

    def shape(self, name: str) -> tuple[int, ...]:
        return self._header(name)[0]

    def dtype(self, name: str) -> str:
        """The tensor's dtype as numpy spells it (``float32``, ``bfloat16``, ``int64`` ...)."""
        dt = self._header(name)[1]
        return _DTYPE_NAMES.get(dt, dt.lower())

    def is_floating(self, name: str) -> bool:
        return self._header(name)[1].startswith(("F", "BF"))

    def read(self, name: str) -> np.ndarray:
        raw = self.names[name]
        if self._header(name)[1] in _ML_DTYPES:
            out = np.array(self._memmap(name))
        else:
            with self._open(self.raw_files[raw]) as f:
                out = f.get_tensor(raw)
        self.bytes_read += out.nbytes
        return out

    def read_slice(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        """``tensor[index]`` (unit-step slices, one per leading axis) read without the rest of the tensor."""
        raw = self.names[name]
        if self._header(name)[1] in _ML_DTYPES:
            out = np.array(self._memmap(name)[tuple(index)])
        else:
            with self._open(self.raw_files[raw]) as f:
                out = f.get_slice(raw)[tuple(index)]
        self.bytes_read += out.nbytes
        return out

    def shape_note(self, name: str) -> str:
        """Words added after a tensor's shape in a mis-shaped report (a quantized reader says how it is packed)."""
        return ""

    bytes_read = 0  # bytes of tensor data read so far (tests count what a sharded load reads)


# ----------------------------------------------------------------------------------------------- matching
def detect_scheme(plan: WeightPlan, names: Mapping[str, str] | set[str], *, prefer: str) -> str:
    """The naming scheme under which the most plan entries find all their tensors (ties: ``prefer``)."""
    schemes = [prefer] + sorted({s for alts in plan.values() for s in alts} - {prefer})

    def found(scheme: str) -> int:
        return sum(all(n in names for n in alts[scheme].names) for alts in plan.values() if scheme in alts)

    return max(schemes, key=found)  # the first maximum: prefer wins ties


def load_weights(plan: WeightPlan, reader: SafetensorsReader, state: nnx.State, *, kind: str, against: str,
                 prefer: str, ignore: re.Pattern | None = None,
                 copies: Mapping[str, tuple[tuple[int, ...], str]] | None = None,
                 preset: Mapping[tuple, object] | None = None, placement=None) -> nnx.State:
    """Build the parameters of ``state`` from checkpoint tensors, as ``plan`` says.

    Args:
      plan: ``{parameter path: {scheme: Source}}`` covering every path of ``state`` except those in ``preset``.
      reader: the checkpoint; ``reader.names`` are matched against the plan's names.
      state: the model's (abstract) NNX state; each parameter takes its dtype from it.
      kind, against: for the error's first line, ``"{kind} checkpoint at {path} does not match {against}"``.
      prefer: the scheme tried first when no scheme matches more plan entries than it (see :func:`detect_scheme`);
        each parameter then takes the first scheme, detected one first, whose tensors are all present.
      ignore: checkpoint names that are neither used nor reported (e.g. a VL release's vision tower).
      copies: ``{name: (shape, why)}`` tensors a checkpoint may carry but the model takes from elsewhere (a
        drafter's frozen copy of the target's embeddings): shape-checked, not loaded.
      preset: ``{parameter path: array}`` values that do not come from the checkpoint.
      placement: for a sharded load, ``placement(path) -> (sharding, checkpoint shape, head map | None, axis)``:
        the parameter is built on the devices of ``sharding``, each device reading only the checkpoint slices of
        its own block (a replicated parameter is read once); ``state`` then has the stored shapes, and the head
        map gives the checkpoint index, along ``axis``, of every stored index (heads replicated for the mesh).
    Returns:
      the filled state. Parameters are cast to the state's dtypes.
    Raises:
      CheckpointError listing every missing, unexpected, mis-shaped and wrongly typed tensor (a floating-point
      parameter needs a floating-point tensor).
    """
    flat = dict(nnx.to_flat_state(state))
    preset = dict(preset or {})
    covered = set(plan) | set(preset)
    if covered != set(flat):
        raise CheckpointError(f"internal: the weight plan does not fit the model: parameters without an entry "
                              f"{sorted(set(flat) - covered)}, entries without a parameter "
                              f"{sorted(covered - set(flat))}")
    scheme = detect_scheme(plan, reader.names, prefer=prefer)
    missing, misshaped, mistyped = [], [], []
    chosen: dict[tuple, Source] = {}
    used: set[str] = set()
    for path, alternatives in plan.items():
        order = [scheme] + [s for s in alternatives if s != scheme]
        src = next((alternatives[s] for s in order
                    if s in alternatives and all(n in reader.names for n in alternatives[s].names)), None)
        if src is None:
            want = alternatives.get(scheme) or next(iter(alternatives.values()))
            missing.extend(n for n in want.names if n not in reader.names)
            continue
        param_dtype = jnp.dtype(flat[path].get_value().dtype)
        for n, shape in zip(src.names, src.shapes):
            used.add(n)
            if reader.shape(n) != shape:
                misshaped.append(f"{reader.names[n]}: expected shape {shape}, found {reader.shape(n)}"
                                 f"{reader.shape_note(n)}")
            if jnp.issubdtype(param_dtype, jnp.floating) and not reader.is_floating(n):
                mistyped.append(f"{reader.names[n]}: found {reader.dtype(n)}, but the {param_dtype.name} parameter "
                                f"{'.'.join(map(str, path))} needs a floating-point tensor")
        chosen[path] = src
    for n, (shape, why) in (copies or {}).items():
        if n in reader.names:
            used.add(n)
            if reader.shape(n) != shape:
                misshaped.append(f"{reader.names[n]}: expected shape {shape} ({why}), found {reader.shape(n)}")
    unexpected = sorted(reader.names[n] for n in reader.names
                        if n not in used and not (ignore is not None and ignore.search(n)))
    if missing or unexpected or misshaped or mistyped:
        parts = [f"{kind} checkpoint at {reader.path} does not match {against} ({scheme} names detected):"]
        if missing:
            parts.append(f"  missing ({len(missing)}): " + ", ".join(missing))
        if unexpected:
            parts.append(f"  unexpected ({len(unexpected)}): " + ", ".join(unexpected))
            if any(_QUANTISED.search(n) for n in unexpected) and kind == "model":
                parts.append("  (scale tensors of quantised weights: a model checkpoint is read as quantised only "
                             "with the quantization_config of its config.json, docs/CHECKPOINTS.md)")
            elif any(_QUANTISED.search(n) for n in unexpected):
                parts.append(f"  (quantised {kind} weights are not supported: dequantise to bf16/fp32 first)")
        if misshaped:
            parts.append(f"  mis-shaped ({len(misshaped)}): " + "; ".join(misshaped))
        if mistyped:
            parts.append(f"  wrong dtype ({len(mistyped)}): " + "; ".join(mistyped))
        raise CheckpointError("\n".join(parts))

    for path, value in preset.items():
        flat[path] = flat[path].replace(value)
    for path, src in chosen.items():
        var = flat[path]
        want = var.get_value()
        if placement is not None:
            flat[path] = var.replace(_placed(src, reader, want, *placement(path)))
            continue
        arr = np.asarray(src.combine([reader.read(n) for n in src.names]))
        if arr.shape != want.shape:
            raise CheckpointError(f"internal: {'.'.join(map(str, path))} built with shape {arr.shape}, the model "
                                  f"expects {want.shape}")
        flat[path] = var.replace(jnp.asarray(arr, dtype=want.dtype))
    return nnx.from_flat_state(flat)


def _placed(src: Source, reader: SafetensorsReader, want, sharding, shape, cols, axis=-1):
    """One parameter built on the devices of ``sharding`` (see :func:`load_weights`' ``placement``)."""
    import jax

    dtype = want.dtype
    axis %= len(want.shape)
    if sharding.is_fully_replicated:
        arr = np.asarray(src.combine([reader.read(n) for n in src.names]))
        if cols is not None:
            arr = np.take(arr, cols, axis=axis)
        return jax.device_put(jnp.asarray(arr, dtype=dtype), sharding)
    memo: dict = {}

    def read_slice(name, slices):  # every distinct slice read once (replicated heads share theirs)
        key = (name, tuple((s.start, s.stop) for s in slices))
        if key not in memo:
            memo[key] = reader.read_slice(name, slices)
        return memo[key]

    def block(index):
        index = tuple(index) + (slice(None),) * (len(want.shape) - len(index))
        if cols is None:
            out = read_block(src, read_slice, index, shape)
        else:
            c = cols[index[axis]]
            lo, hi = int(c.min()), int(c.max()) + 1
            spans = index[:axis] + (slice(lo, hi),) + index[axis + 1:]
            out = np.take(read_block(src, read_slice, spans, shape), c - lo, axis=axis)
        return np.asarray(jnp.asarray(out, dtype=dtype))

    return jax.make_array_from_callback(tuple(want.shape), sharding, block)


__all__ = ["CheckpointError", "SafetensorsReader", "Source", "checkpoint_directory", "compose_rename",
           "concat_rows", "concat_transpose", "detect_scheme", "identity", "load_weights", "read_block", "rows_of_parts",
           "to_checkpoint_tensors", "transpose"]
