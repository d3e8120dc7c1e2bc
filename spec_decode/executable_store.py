"""Compiled programs kept on disk as executables: a warm start loads them without tracing or lowering.

JAX's persistent compilation cache (:mod:`spec_decode.compilation_cache`) keys a program by its lowered module, so a
second process still traces and lowers every program of the engine's closed set before the cache can answer: about
a minute at 256 slots on an H200, where the closed set is 37 programs (docs/ENGINE.md "Start-up"). This store keys
each program by what determines it *before* tracing, and keeps the executable that
``jax.experimental.serialize_executable`` writes:

- the software: this project's source (every ``.py`` file of ``pallas_kernels``, ``minimax_jax`` and
  ``spec_decode``), and the versions of jax, jaxlib and flax;
- the machine: the backend, its platform version, the devices' kinds, ``XLA_FLAGS``, the JAX options that change
  what is compiled, and whether short loops are traced unrolled (``pallas_kernels.platform.unroll_loops``);
- the program: the models' graph definitions (their configs and every static attribute, the weights excluded), the
  shapes, dtypes and placements of every argument (parameters, decode state, plan), the step or loop
  configuration, and the program's key in the closed set.

Any change to one of them gives another key, so a stale executable is never loaded; a file that fails to load is
dropped and the program compiles as usual.

Within one process, engines with the same key also share their compiled programs (:func:`recall`,
:func:`remember`, on every engine, the store on disk or not) while an engine holds them: programs are kept by weak
reference, so they go when the last engine using them goes (on a CPU every live executable holds memory maps of
its code, and a process may map only so many). A second engine with the same settings, a notebook cell re-run
while its engine is alive, or a test beside a fixture's engine starts without compiling. A program holds
no weights and no state (both are arguments), so sharing it is safe. Their key adds :func:`live_code`, the
identity of every function, class and module-level value of the three packages as they are *now*, so code
replaced at run time (a test's monkeypatch) is traced anew; the store on disk cannot see such replacements. The store lives beside the compilation cache
(``$MINIMAX_JAX_CACHE_DIR/../executables``, by default ``~/.cache/minimax-jax/executables``), is least-recently-used
trimmed to :data:`MAX_BYTES`, and is off with the compilation cache (``MINIMAX_JAX_COMPILATION_CACHE=0``,
``Engine(compilation_cache=False)``). Programs placed on a multi-device mesh are not stored (they compile, through
the compilation cache).
"""

from __future__ import annotations

import hashlib
import os
import pickle
import sys
import tempfile
import threading
import warnings
import weakref

import jax
import numpy as np

from pallas_kernels.platform import unroll_loops
from spec_decode import compilation_cache

__all__ = ["MAX_BYTES", "ExecutableStore", "abstract", "from_bytes", "live_code", "program_digest", "recall", "remember",
           "source_digest", "stores_cache_loads"]

MAX_BYTES = 8 << 30  # the store's size on disk, kept by removing the least recently used executables
# (key, live code) -> a program some engine of this process holds (weakly: it goes with the last engine)
_memory: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_memory_lock = threading.Lock()
_PACKAGES = ("pallas_kernels", "minimax_jax", "spec_decode")
_JAX_OPTIONS = ("jax_enable_x64", "jax_default_matmul_precision", "jax_default_prng_impl", "jax_threefry_partitionable",
                "jax_numpy_rank_promotion", "jax_pallas_use_mosaic_gpu")
_source = None


def source_digest() -> str:
    """A digest of this project's Python source (computed once per process)."""
    global _source
    if _source is None:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        h = hashlib.sha256()
        for pkg in _PACKAGES:
            base = os.path.join(root, pkg)
            for dirpath, dirnames, filenames in os.walk(base):
                dirnames.sort()
                for name in sorted(filenames):
                    if name.endswith(".py"):
                        path = os.path.join(dirpath, name)
                        h.update(os.path.relpath(path, root).encode())
                        with open(path, "rb") as f:
                            h.update(f.read())
        _source = h.hexdigest()
    return _source


def _environment() -> tuple:
    import flax
    import jaxlib

    devices = jax.devices()
    options = tuple((name, str(getattr(jax.config, name, None))) for name in _JAX_OPTIONS)
    return (jax.__version__, jaxlib.__version__, flax.__version__, jax.default_backend(),
            getattr(devices[0].client, "platform_version", ""), tuple(getattr(d, "device_kind", "") for d in devices),
            os.environ.get("XLA_FLAGS", ""), options, ("unroll_loops", unroll_loops()), source_digest())


def abstract(tree) -> tuple:
    """What a program sees of ``tree``: its structure and each leaf's shape, dtype and placement (the sharding and
    its devices; not the values)."""
    leaves, treedef = jax.tree.flatten(tree)

    def placement(sharding) -> tuple:
        # the repr of a NamedSharding names the mesh's axes, not its devices: their ids, in the mesh's order
        if sharding is None:
            return ()
        devices = getattr(getattr(sharding, "mesh", None), "devices", None)
        ids = ([int(d.id) for d in np.ravel(devices)] if devices is not None
               else sorted(int(d.id) for d in sharding.device_set))
        return repr(sharding), tuple(ids)

    def leaf(x):
        return (tuple(getattr(x, "shape", ())), str(getattr(x, "dtype", type(x).__name__)),
                placement(getattr(x, "sharding", None)))

    return repr(treedef), tuple(leaf(x) for x in leaves)


def program_digest(*parts) -> str:
    """The store's key of one program: the software and machine (see the module docstring) and ``parts``."""
    return hashlib.sha256(repr((_environment(),) + parts).encode()).hexdigest()


def stores_cache_loads() -> bool:
    """Whether an executable that JAX's persistent compilation cache loaded may be kept in the store. Not on a CPU:
    there (jax 0.12.0.1) such an executable serialises without its machine code, loads in the next process, and
    fails at its first run (``NOT_FOUND: Function ... not found``). The program then comes from the JAX cache in
    every process (traced and lowered, not compiled) until a compilation stores it: after the cache is cleared,
    or when its key there changes too. ``tests/test_engine_serving.py`` runs the sequence. On a GPU (jax 0.11.2,
    an H100) the same sequence loads and runs."""
    return jax.default_backend() != "cpu"


def live_code() -> str:
    """A digest of what this process's modules of the three packages hold now: the identity of each module
    attribute and class attribute (and the value of simple constants). Replacing one at run time changes it."""
    h = hashlib.sha256()
    modules = dict(sys.modules)  # a copy: another thread may import meanwhile
    for name in sorted(n for n in modules if n.split(".")[0] in _PACKAGES):
        for attr, value in sorted(dict(getattr(modules[name], "__dict__", {})).items(), key=lambda kv: kv[0]):
            h.update(f"{name}.{attr}:{id(value)}".encode())
            if isinstance(value, (bool, int, float, str)):
                h.update(repr(value).encode())
            elif isinstance(value, type) and value.__module__ == name:
                for cattr, cvalue in sorted(dict(vars(value)).items(), key=lambda kv: kv[0]):
                    h.update(f"{cattr}:{id(cvalue)}".encode())
    return h.hexdigest()


def recall(digest: str, live: str):
    """The program compiled (or loaded) under ``digest`` earlier in this process with the code as ``live``
    (:func:`live_code`), or None."""
    with _memory_lock:
        return _memory.get((digest, live))


def remember(digest: str, live: str, compiled) -> None:
    """Offer ``compiled`` to later engines of this process with the same key and code, while it lives."""
    with _memory_lock:
        _memory[(digest, live)] = compiled


def from_bytes(raw: bytes):
    """The executable (a ``jax.stages.Compiled``) of a stored file's bytes, loaded onto this process's devices."""
    from jax.experimental.serialize_executable import deserialize_and_load

    payload, in_tree, out_tree = pickle.loads(raw)
    return deserialize_and_load(payload, in_tree, out_tree)


class ExecutableStore:
    """Executables on disk under ``root``, one file per :func:`program_digest`."""

    def __init__(self, root: str):
        self.root = root
        os.makedirs(root, exist_ok=True)

    @classmethod
    def default(cls) -> ExecutableStore | None:
        """The store beside the engine's compilation cache, or None when the cache is opted out of."""
        if not compilation_cache.enabled():
            return None
        return cls(os.path.join(os.path.dirname(compilation_cache.cache_dir()), "executables"))

    def _path(self, digest: str) -> str:
        return os.path.join(self.root, f"{digest}.exe")

    def load(self, digest: str):
        """The executable stored under ``digest`` (a ``jax.stages.Compiled``), or None. A file that does not load
        is removed."""
        path = self._path(digest)
        if not os.path.exists(path):
            return None
        try:
            with open(path, "rb") as f:
                compiled = from_bytes(f.read())
        except Exception as e:  # noqa: BLE001 - a damaged or incompatible file: compile instead
            warnings.warn(f"dropping the stored executable {path}: {type(e).__name__}: {e}", stacklevel=2)
            try:
                os.remove(path)
            except OSError:
                pass
            return None
        try:
            os.utime(path)  # least recently used is trimmed first
        except OSError:
            pass
        return compiled

    def save(self, digest: str, compiled, *, from_cache: bool = False) -> None:
        """Keep ``compiled`` under ``digest`` (written atomically); a failure warns and is otherwise ignored.
        ``from_cache``: JAX's persistent compilation cache loaded it (nothing compiled); on a CPU it is not kept
        (:func:`stores_cache_loads`)."""
        if from_cache and not stores_cache_loads():
            return
        try:
            from jax.experimental.serialize_executable import serialize

            blob = pickle.dumps(serialize(compiled), protocol=pickle.HIGHEST_PROTOCOL)
            fd, tmp = tempfile.mkstemp(dir=self.root, suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                f.write(blob)
            os.replace(tmp, self._path(digest))
        except Exception as e:  # noqa: BLE001 - not every executable serialises; it is compiled next time
            warnings.warn(f"could not store an executable: {type(e).__name__}: {e}", stacklevel=2)
            return
        self.trim()

    def trim(self, max_bytes: int = MAX_BYTES) -> None:
        """Remove the least recently used executables until the store holds at most ``max_bytes``."""
        try:
            files = [os.path.join(self.root, n) for n in os.listdir(self.root) if n.endswith(".exe")]
            stats = sorted(((os.stat(p), p) for p in files), key=lambda sp: sp[0].st_mtime)
        except OSError:
            return
        total = sum(st.st_size for st, _ in stats)
        for st, path in stats:
            if total <= max_bytes:
                break
            try:
                os.remove(path)
                total -= st.st_size
            except OSError:
                pass
