"""Backend selection shared by every kernel: interpret mode, the Triton deprecation filter, deviceless lowering.

JAX has deprecated the Triton lowering of Pallas, but on ROCm it is still the only Pallas path. Kernels in this
package therefore sit behind a small dispatch layer: ``resolve_interpret`` decides between compiled Triton
kernels (CUDA or ROCm) and Pallas interpret mode (CPU), and the public entry points fall back to the pure-JAX
``*_reference`` when asked to (``implementation="reference"``).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import jax

# Exactly the warning JAX emits when a pallas_call is lowered through Triton; nothing broader is silenced.
TRITON_DEPRECATION_MESSAGE = r"The Pallas Triton backend is deprecated"

_GPU_PLATFORMS = ("gpu", "cuda", "rocm")


def filter_triton_deprecation() -> None:
    """Silence only JAX's deprecation warning for the Pallas Triton backend."""
    warnings.filterwarnings("ignore", message=TRITON_DEPRECATION_MESSAGE, category=DeprecationWarning)


filter_triton_deprecation()


def on_gpu() -> bool:
    """True when JAX's default backend is a GPU (CUDA or ROCm)."""
    return jax.default_backend() in _GPU_PLATFORMS


_unroll_override: bool | None = None  # set by loops_unrolled()


def unroll_loops() -> bool:
    """Whether the short loops of a decode program (the drafter's draft positions; the sampler's 32-step bisection
    on vocabulary shards) are unrolled when traced. On a GPU they are: a rolled loop is an XLA while loop, which a
    GPU drives from the host, a predicate read back and a launch per iteration (docs/BENCHMARKS.md, "The launch of
    a host step"). Elsewhere (a CPU) a while loop runs where its body does, and a rolled body compiles once: the
    test suite's engines warm up about a tenth faster (docs/ENGINE.md, "The closed program set"). Same math.
    :func:`loops_unrolled` overrides it."""
    return on_gpu() if _unroll_override is None else _unroll_override


@contextlib.contextmanager
def loops_unrolled(unroll: bool = True):
    """Programs traced inside unroll their short loops (``unroll=False``: keep them rolled) on any backend.
    ``scripts/profile_step.py`` profiles the program a GPU runs op by op, and in a CPU trace the ops of a rolled
    loop lose their name scopes. Only tracing sees it: a program already compiled keeps its loops."""
    global _unroll_override
    before, _unroll_override = _unroll_override, bool(unroll)
    try:
        yield
    finally:
        _unroll_override = before


def resolve_auto(implementation: str, *, interpret: bool | None, supported, choices=("auto", "pallas", "reference"),
                 fallback: str = "reference") -> str:
    """The one ``"auto"`` rule every kernel family shares: a name of ``choices`` other than ``"auto"`` passes
    through; ``"auto"`` is Pallas interpret mode with ``interpret=True``, the compiled kernel (``"pallas"``) on a
    GPU where ``supported()`` says the shapes compile, else ``fallback``. Unknown names raise ValueError."""
    if implementation not in choices:
        raise ValueError(f"implementation must be one of {tuple(choices)}, got {implementation!r}")
    if implementation != "auto":
        return implementation
    if interpret:
        return "pallas"
    return "pallas" if on_gpu() and supported() else fallback


def resolve_interpret(interpret: bool | None) -> bool:
    """``None`` means: interpret mode on CPU, compiled Triton kernels on a GPU."""
    if interpret is None:
        return not on_gpu()
    return bool(interpret)


def gpu_platform_name() -> str | None:
    """``"cuda"`` or ``"rocm"`` for the default device, ``None`` off GPU.

    JAX reports both as platform ``"gpu"``; the client's platform version names the runtime.
    """
    if not on_gpu():
        return None
    backend = jax.default_backend()
    if backend in ("cuda", "rocm"):
        return backend
    dev = jax.devices()[0]
    text = f"{getattr(dev.client, 'platform_version', '')} {getattr(dev, 'device_kind', '')}".lower()
    return "rocm" if ("rocm" in text or "hip" in text or "gfx" in text) else "cuda"


# Abstract GPUs used by the deviceless lowering check: one NVIDIA Hopper and one AMD CDNA3 part.
ABSTRACT_GPUS = {"cuda": "NVIDIA H200", "rocm": "gfx942"}


@contextlib.contextmanager
def abstract_gpu(platform: str) -> Iterator[None]:
    """Pretend the default device is a GPU of ``platform`` (``"cuda"`` or ``"rocm"``) while lowering.

    Used with ``jax.jit(f).trace(*args).lower(lowering_platforms=(platform,))`` to prove a kernel lowers
    to Triton for CUDA and ROCm on a machine without a GPU.
    """
    from jax._src.mesh import AbstractDevice  # no public constructor yet in jax 0.11

    if platform not in ABSTRACT_GPUS:
        raise ValueError(f"platform must be one of {sorted(ABSTRACT_GPUS)}, got {platform!r}")
    device = AbstractDevice(device_kind=ABSTRACT_GPUS[platform], num_cores=None, platform="gpu")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
    with jax.sharding.use_abstract_mesh(mesh):
        yield


def lowered_for_gpu(fn, *args, platform: str, **kwargs) -> jax.stages.Lowered:
    """Lower ``fn(*args, **kwargs)`` for ``platform`` without a GPU (``args`` may be ``jax.ShapeDtypeStruct``s).

    Each Pallas kernel is a ``__gpu$xla.gpu.triton`` custom call in the result; ``compile_check`` compiles them.
    """
    with abstract_gpu(platform):
        return jax.jit(lambda *a: fn(*a, **kwargs)).trace(*args).lower(lowering_platforms=(platform,))


def lower_for_gpu(fn, *args, platform: str, **kwargs) -> str:
    """:func:`lowered_for_gpu` as StableHLO text, which contains the serialized Triton kernel calls."""
    return lowered_for_gpu(fn, *args, platform=platform, **kwargs).as_text()
