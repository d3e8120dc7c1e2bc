"""Quantized MiniMax-M3 checkpoints: the ``quantization_config`` of ``config.json``, and reading MX weights.

Two schemes are read, the two the published releases use (docs/CHECKPOINTS.md has the schemas and their sources):

* ``quant_method: "mxfp8"`` (``MiniMaxAI/MiniMax-M3-MXFP8``): every linear that no ``ignored_layers`` entry names is
  a ``float8_e4m3fn`` ``weight [N, K]`` with a uint8 E8M0 ``weight_scale_inv [N, K/32]`` beside it
  (``weight_block_size: [1, 32]``, dynamic activations);
* ``quant_method: "quark"`` with OCP MXFP4 weights (``amd/MiniMax-M3-MXFP4``): every linear that no ``exclude``
  entry matches is a packed uint8 ``weight [N, K/2]`` with a uint8 E8M0 ``weight_scale [N, K/32]``.

Anything else (another ``quant_method``, block-scaled FP8 of DeepSeek's kind, static activation scales, other
group sizes or scale formats, per-layer schemes) is refused with a :class:`~minimax_jax.config.ConfigError` naming
the key and the value. Which linears are quantized comes from the config's lists alone (:meth:`QuantizationScheme
.exclusion`); the loader checks that the checkpoint agrees, tensor by tensor.

:class:`DequantizingReader` wraps a :class:`~minimax_jax.safetensors_io.SafetensorsReader` so that a quantized
weight reads as its dense values (``pallas_kernels.mx_formats.dequantize``, on the host CPU), whole or by slice (the
sharded loader reads only each device's block: a column slice decodes the 32-column blocks it touches). Weights the
caller keeps quantized (``keep``) read as shipped, scales beside them.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import os
import re
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np

from minimax_jax.config import ConfigError, ConfigWarning
from minimax_jax.safetensors_io import CheckpointError
from pallas_kernels import mx_formats

__all__ = ["SCALE_SUFFIX", "DequantizingReader", "QuantizationScheme", "matches_rule", "read_quantization_config"]

# The scale tensor beside ``<module>.weight`` in each weight format's release.
SCALE_SUFFIX = {"mxfp8": "weight_scale_inv", "mxfp4": "weight_scale"}
_RELEASES = "'mxfp8' (MiniMaxAI/MiniMax-M3-MXFP8) and 'quark' with OCP MXFP4 weights (amd/MiniMax-M3-MXFP4)"


def matches_rule(name: str, rule: str) -> bool:
    """Whether the module ``name`` is matched by one ``ignored_layers`` / ``exclude`` entry.

    * ``re:<pattern>``: the regular expression matches at the start of the name (vLLM's quark rule);
    * an entry with ``*``, ``?`` or ``[``: a glob over the whole name, or over a module above it
      (``*self_attn*``; ``*block_sparse_moe.gate`` also matches ``...gate.weight``), as ATOM reads Quark's lists;
    * any other entry: a run of whole dotted components of the name (``lm_head``, ``vision_tower`` matches the
      tower's submodules, ``model.embed_tokens`` matches ``language_model.model.embed_tokens``), vLLM's substring
      rule for ``ignored_layers`` restricted to component boundaries (``...moe.gate`` does not match ``gate_proj``).
    """
    if rule.startswith("re:"):
        return re.match(rule[3:], name) is not None
    if any(c in rule for c in "*?["):
        return fnmatch.fnmatchcase(name, rule) or fnmatch.fnmatchcase(name, rule + ".*")
    return f".{rule}." in f".{name}."


@dataclasses.dataclass(frozen=True)
class QuantizationScheme:
    """A checkpoint's quantization, as read from its ``quantization_config``."""

    method: str  # "mxfp8" | "quark"
    weight_format: str  # "mxfp8" | "mxfp4" (pallas_kernels.mx_formats.FORMATS)
    excluded: tuple[str, ...]  # the entries of the list below
    exclude_key: str  # "ignored_layers" | "exclude": where the entries came from (for messages)

    @property
    def scale_suffix(self) -> str:
        return SCALE_SUFFIX[self.weight_format]

    def exclusion(self, *module_names: str) -> str | None:
        """The first entry that matches any of ``module_names`` (the checkpoint's name and the text model's),
        or None: the module is quantized."""
        for rule in self.excluded:
            if any(matches_rule(n, rule) for n in module_names):
                return rule
        return None


# ----------------------------------------------------------------------------------------------- parsing
def read_quantization_config(raw: Mapping[str, Any]) -> QuantizationScheme | None:
    """The scheme of a parsed ``config.json`` (``quantization_config`` at the top level, or inside
    ``text_config``), or None for an unquantized checkpoint. Raises :class:`ConfigError` naming what is not
    supported."""
    q = raw.get("quantization_config")
    text = raw.get("text_config")
    if q is None and isinstance(text, Mapping):
        q = text.get("quantization_config")
    if q is None:
        return None
    if not isinstance(q, Mapping):
        raise ConfigError(f"quantization_config must be an object, got {type(q).__name__}")
    method = q.get("quant_method")
    if method == "mxfp8":
        return _mxfp8(q)
    if method == "quark":
        return _quark(q)
    raise ConfigError(f"quantization_config.quant_method={method!r} is not supported; supported: {_RELEASES}")


def _rules(q: Mapping, keys: Iterable[str]) -> tuple[tuple[str, ...], str]:
    for key in keys:
        v = q.get(key)
        if v:
            if not isinstance(v, (list, tuple)) or not all(isinstance(r, str) for r in v):
                raise ConfigError(f"quantization_config.{key} must be a list of strings, got {v!r}")
            return tuple(v), key
    return (), next(iter(keys))


def _unknown(q: Mapping, known: set[str], where: str) -> None:
    extra = sorted(k for k in q if k not in known)
    if extra:
        warnings.warn(f"{where} keys not used by the loader (ignored): {', '.join(extra)}", ConfigWarning,
                      skip_file_prefixes=(os.path.dirname(os.path.abspath(__file__)),))


def _mxfp8(q: Mapping) -> QuantizationScheme:
    act = q.get("activation_scheme", "dynamic")
    if act != "dynamic":
        raise ConfigError(f"quantization_config.activation_scheme={act!r} is not supported (only 'dynamic': no "
                          f"activation scales are read)")
    block = q.get("weight_block_size", [1, mx_formats.BLOCK])
    if list(block) != [1, mx_formats.BLOCK]:
        raise ConfigError(f"quantization_config.weight_block_size={list(block)!r} is not MXFP8's [1, "
                          f"{mx_formats.BLOCK}] (block-scaled FP8 with float scales is not supported)")
    fmt = q.get("fmt", "e4m3")
    if fmt not in ("e4m3", "float8_e4m3fn"):
        raise ConfigError(f"quantization_config.fmt={fmt!r} is not supported (only e4m3 elements)")
    if q.get("kv_cache_scheme") is not None:
        raise ConfigError("quantization_config.kv_cache_scheme: quantized KV caches are not supported")
    rules, key = _rules(q, ("ignored_layers", "modules_to_not_convert"))
    _unknown(q, {"quant_method", "activation_scheme", "weight_block_size", "fmt", "kv_cache_scheme",
                 "ignored_layers", "modules_to_not_convert"}, "quantization_config")
    return QuantizationScheme("mxfp8", "mxfp8", rules, key)


# Quark's weight spec of OCP MXFP4: key -> accepted values (absent keys take the first).
_QUARK_MXFP4 = {
    "dtype": ("fp4",),
    "qscheme": ("per_group",),
    "group_size": (mx_formats.BLOCK,),
    "scale_format": ("e8m0",),
    "is_dynamic": (False,),
    "ch_axis": (-1, 1),
}


def _quark_layer(spec: Any, where: str) -> None:
    if not isinstance(spec, Mapping):
        raise ConfigError(f"{where} must be an object, got {type(spec).__name__}")
    weight = spec.get("weight")
    if not isinstance(weight, Mapping):
        raise ConfigError(f"{where}.weight must be an object (one weight quantizer), got {weight!r}")
    for key, ok in _QUARK_MXFP4.items():
        v = weight.get(key, ok[0])
        if v not in ok:
            want = " or ".join(map(repr, ok))
            raise ConfigError(f"{where}.weight.{key}={v!r} is not supported (OCP MXFP4 weights need {want})")
    for key in ("output_tensors", "bias"):
        if spec.get(key) is not None:
            raise ConfigError(f"{where}.{key}: quantized {key.replace('_', ' ')} are not supported")
    inp = spec.get("input_tensors")
    if inp is not None and (not isinstance(inp, Mapping) or inp.get("is_dynamic") is False):
        raise ConfigError(f"{where}.input_tensors: static activation scales are not supported (only dynamic "
                          f"activation quantization, which the loader leaves to the kernels)")


def _quark(q: Mapping) -> QuantizationScheme:
    glob = q.get("global_quant_config")
    if glob is None:
        raise ConfigError("quantization_config.global_quant_config is missing (a Quark config names its weight "
                          "quantizer there)")
    _quark_layer(glob, "quantization_config.global_quant_config")
    for key in ("layer_quant_config", "layer_type_quant_config"):
        per = q.get(key) or {}
        if not isinstance(per, Mapping):
            raise ConfigError(f"quantization_config.{key} must be an object, got {type(per).__name__}")
        for pattern, spec in per.items():
            if spec != glob:
                raise ConfigError(f"quantization_config.{key}[{pattern!r}]: per-layer quantization schemes are not "
                                  f"supported (every quantized linear must use global_quant_config)")
    export = q.get("export") or {}
    if not isinstance(export, Mapping):
        raise ConfigError(f"quantization_config.export must be an object, got {type(export).__name__}")
    if export.get("kv_cache_group"):
        raise ConfigError(f"quantization_config.export.kv_cache_group={export['kv_cache_group']!r}: quantized KV "
                          f"caches are not supported")
    wf = export.get("weight_format", "real_quantized")
    if wf != "real_quantized":
        raise ConfigError(f"quantization_config.export.weight_format={wf!r} is not supported (only "
                          f"'real_quantized': packed weights with their scales)")
    rules, key = _rules(q, ("exclude",))
    return QuantizationScheme("quark", "mxfp4", rules, key)


# ----------------------------------------------------------------------------------------------- reading
def _module(name: str) -> str:
    return name[: -len(".weight")] if name.endswith(".weight") else name


class DequantizingReader:
    """A :class:`~minimax_jax.safetensors_io.SafetensorsReader` whose quantized linears read as dense ``dtype``.

    Args:
      reader: the checkpoint.
      scheme: its quantization.
      linear_names: the (matching) names of every tensor a linear parameter is built from (the weight plan's);
        only these may be quantized.
      expected_shapes: ``{name: dense shape}`` of those tensors, from the config (the packed K is checked
        against it).
      keep: names read as shipped (packed elements; their scales stay visible under their own names).
      dtype: the dense dtype of decoded weights.

    Construction reads headers only and raises one :class:`CheckpointError` listing every quantized tensor that
    does not fit: a missing scale, a scale on an excluded linear, the wrong element or scale dtype, a scale shape
    that does not match its weight, a packed K that does not match the config.
    """

    def __init__(self, reader, scheme: QuantizationScheme, *, linear_names: Iterable[str],
                 expected_shapes: Mapping[str, tuple[int, ...]], keep: Callable[[str], bool] = lambda n: False,
                 dtype=np.float32):
        self._base = reader
        self.scheme = scheme
        self.path = reader.path
        self.dtype_ = np.dtype(dtype)
        fmt, suffix = scheme.weight_format, scheme.scale_suffix
        self._dense: dict[str, str] = {}  # weight name -> its scale's name (decoded on read)
        hidden: set[str] = set()
        problems = []
        for n in sorted(set(linear_names) & set(reader.names)):
            module, raw = _module(n), reader.names[n]
            scale = f"{module}.{suffix}"
            rule = scheme.exclusion(_module(raw), module)
            has_scale = scale in reader.names
            if rule is not None:
                if has_scale:
                    problems.append(f"{reader.names[scale]}: {_module(raw)} is excluded from quantization by the "
                                    f"{scheme.exclude_key} entry {rule!r}, yet carries a {suffix}")
                continue
            if not has_scale:
                problems.append(f"{raw}: no {scheme.exclude_key} entry matches {_module(raw)}, so quantization_config "
                                f"says it is {fmt}, but there is no {_module(raw)}.{suffix}")
                continue
            want = expected_shapes.get(n)
            shape = reader.shape(n)
            k = want[-1] if want else shape[-1] * (2 if fmt == "mxfp4" else 1)
            try:
                mx_formats.check_mx_shapes(fmt, shape, _np_dtype(reader.dtype(n)), reader.shape(scale),
                                           _np_dtype(reader.dtype(scale)), in_features=k, name=raw)
            except ValueError as e:
                problems.append(f"{e} (the config's input dimension is {k})" if want else str(e))
                continue
            if not keep(n):
                self._dense[n] = scale
                hidden.add(scale)
        if problems:
            raise CheckpointError(f"quantized checkpoint at {reader.path} ({scheme.method}, {fmt} weights) does not "
                                  f"match its quantization_config or the config ({len(problems)}):\n  "
                                  + "\n  ".join(problems))
        self.names = {k: v for k, v in reader.names.items() if k not in hidden}

    @property
    def dequantized(self) -> tuple[str, ...]:
        """Names of the weights decoded on read."""
        return tuple(self._dense)

    @property
    def bytes_read(self) -> int:
        return self._base.bytes_read

    def _packing(self) -> int:
        return 2 if self.scheme.weight_format == "mxfp4" else 1

    def shape(self, name: str) -> tuple[int, ...]:
        shape = self._base.shape(name)
        if name in self._dense:
            return (*shape[:-1], shape[-1] * self._packing())
        return shape

    def shape_note(self, name: str) -> str:
        if name not in self._dense:
            return ""
        fmt = self.scheme.weight_format
        return (f" (decoded from {fmt}: {self._base.dtype(name)} {self._base.shape(name)}"
                + (", two elements per byte" if fmt == "mxfp4" else "") + ")")

    def dtype(self, name: str) -> str:
        return self.dtype_.name if name in self._dense else self._base.dtype(name)

    def is_floating(self, name: str) -> bool:
        return True if name in self._dense else self._base.is_floating(name)

    def _decode(self, w: np.ndarray, s: np.ndarray) -> np.ndarray:
        import jax

        try:  # on the host: the decoded tensor goes back to numpy for the loader
            device = jax.local_devices(backend="cpu")[0]
        except RuntimeError:  # JAX_PLATFORMS without cpu
            device = jax.local_devices()[0]
        with jax.default_device(device):
            return np.asarray(mx_formats.dequantize(self.scheme.weight_format, w, s, dtype=self.dtype_))

    def read(self, name: str) -> np.ndarray:
        if name not in self._dense:
            return self._base.read(name)
        return self._decode(self._base.read(name), self._base.read(self._dense[name]))

    def read_slice(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        if name not in self._dense:
            return self._base.read_slice(name, index)
        shape = self.shape(name)
        index = tuple(index) + (slice(None),) * (len(shape) - len(index))
        c0, c1, step = index[-1].indices(shape[-1])
        if step != 1:
            raise ValueError(f"only unit-step slices are read, got {index[-1]}")
        b0, b1 = c0 // mx_formats.BLOCK, -(-c1 // mx_formats.BLOCK)  # the scale blocks the columns touch
        per = mx_formats.BLOCK // self._packing()  # stored columns per block
        w = self._base.read_slice(name, (*index[:-1], slice(b0 * per, b1 * per)))
        s = self._base.read_slice(self._dense[name], (*index[:-1], slice(b0, b1)))
        off = b0 * mx_formats.BLOCK
        return self._decode(w, s)[..., c0 - off:c1 - off]


def _np_dtype(name: str) -> np.dtype:
    if name.startswith("float8"):
        import ml_dtypes

        return np.dtype(getattr(ml_dtypes, name))
    return np.dtype(name)
