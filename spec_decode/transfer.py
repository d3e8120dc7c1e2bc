"""A tree of small arrays as one ``int32`` vector: one transfer between host and device instead of one per array.

Every array that crosses between the host and the device is a transfer of its own: on a GPU a copy, an event and
host callbacks, tens of microseconds of host time whatever its size. The device loop's inputs are 33 small
arrays and its outputs 18-21; a call paid for each (docs/ENGINE.md, "The device loop"). Packed, each side sends
one vector:

* :class:`PackedLayout`: where each array lies in the vector (the tree's structure, each leaf's shape and
  kind). It is static: fixed by the program's configuration, known to both sides without a transfer.
* host to device: :func:`pack_host` (numpy) and :func:`unpack_device` (traced, static slices);
* device to host: :func:`pack_device` (traced, one concatenation) and :func:`unpack_host` (numpy views of the
  one buffer read back).

Kinds: ``int32`` as is, ``float32`` bit-cast (every bit kept: ``-0.0``, infinities, NaN payloads), ``bool`` as
0 / 1. A step's plan travels the same way, in a layout of its own (``spec_decode.programs.pack_plan``).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["PackedLayout", "pack_device", "pack_host", "unpack_device", "unpack_host"]

_KINDS = {np.dtype(np.int32): "int32", np.dtype(np.float32): "float32", np.dtype(np.bool_): "bool"}


def _kind(x) -> str:
    dtype = np.dtype(x.dtype) if hasattr(x, "dtype") else np.asarray(x).dtype
    if dtype not in _KINDS:
        raise TypeError(f"a packed tree holds int32, float32 and bool arrays only, got {dtype}")
    return _KINDS[dtype]


@dataclasses.dataclass(frozen=True)
class PackedLayout:
    """The tree's structure and, per leaf in tree order, its shape and kind (``int32``, ``float32``, ``bool``)."""

    treedef: object
    leaves: tuple[tuple[tuple[int, ...], str], ...]

    @classmethod
    def of(cls, tree) -> PackedLayout:
        """The layout of ``tree``: host arrays, device arrays, tracers or ``jax.ShapeDtypeStruct`` leaves."""
        leaves, treedef = jax.tree.flatten(tree)
        return cls(treedef, tuple((tuple(np.shape(x)), _kind(x)) for x in leaves))

    @property
    def size(self) -> int:
        """The packed vector's length."""
        return sum(math.prod(shape) for shape, _ in self.leaves)

    def _check(self, packed, what: str) -> None:
        if tuple(packed.shape) != (self.size,) or np.dtype(packed.dtype) != np.int32:
            raise ValueError(f"{what} must be int32[{self.size}], got {packed.dtype}{list(packed.shape)}")


def pack_host(tree) -> np.ndarray:
    """Numpy side: every array of ``tree`` (host arrays) in one flat ``int32`` vector, in tree order."""
    parts = []
    for x in jax.tree.leaves(tree):
        a = np.asarray(x)
        parts.append((a.view(np.int32) if _kind(a) == "float32" else a.astype(np.int32, copy=False)).ravel())
    return np.concatenate(parts) if parts else np.zeros(0, np.int32)


def unpack_device(packed: jax.Array, layout: PackedLayout):
    """Device side (traced): the tree back from :func:`pack_host`'s vector, by static slices of ``layout``."""
    return _unpack(packed, layout, lambda x: jax.lax.bitcast_convert_type(x, jnp.float32))


def pack_device(tree, layout: PackedLayout | None = None) -> jax.Array:
    """Device side (traced): every array of ``tree`` in one flat ``int32`` vector, in tree order. With ``layout``,
    the tree must have it (the host unpacks by it): a tree of another shape is a ``ValueError`` at trace time."""
    if layout is not None and PackedLayout.of(tree) != layout:
        raise ValueError(f"the tree to pack does not have the host's layout: {PackedLayout.of(tree)} against "
                         f"{layout}")
    parts = []
    for x in jax.tree.leaves(tree):
        kind = _kind(x)
        x = jnp.asarray(x)
        parts.append((jax.lax.bitcast_convert_type(x, jnp.int32) if kind == "float32" else
                      x.astype(jnp.int32)).reshape(-1))
    return jnp.concatenate(parts) if parts else jnp.zeros(0, jnp.int32)


def unpack_host(packed: np.ndarray, layout: PackedLayout):
    """Numpy side: the tree back from :func:`pack_device`'s vector (read back), as views of it (booleans
    copied)."""
    return _unpack(np.asarray(packed), layout, lambda x: x.view(np.float32))


def _unpack(packed, layout: PackedLayout, as_float32):
    """The tree of ``layout`` from ``packed`` (numpy or traced), each leaf a static slice reshaped: floats by
    ``as_float32`` (a bit-cast), booleans as ``!= 0``."""
    layout._check(packed, "a packed vector")
    leaves, at = [], 0
    for shape, kind in layout.leaves:
        n = math.prod(shape)
        x = packed[at:at + n].reshape(shape)
        at += n
        leaves.append(as_float32(x) if kind == "float32" else x != 0 if kind == "bool" else x)
    return jax.tree.unflatten(layout.treedef, leaves)
