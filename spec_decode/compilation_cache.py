"""The engine's caches on disk: JAX's persistent compilation cache and the profiled cost tables, on by default.

``Engine(...)`` calls :func:`enable`: compiled programs (the closed step set, the device loop, their Triton
kernels) are written to ``$MINIMAX_JAX_CACHE_DIR`` or ``$XDG_CACHE_HOME/minimax-jax/jax`` (default
``~/.cache/minimax-jax/jax``), so a second process with the same model and settings loads them instead of
compiling. Small programs are kept too (JAX's default keeps only programs that took a second or more to
compile). The cost tables the engine profiles at warm-up are kept beside them (``.../minimax-jax/cost_tables``), one
JSON file per (device, model, drafter, dtype, engine settings, jax version): a second engine with the same key loads
its table instead of profiling. Compiled programs are also kept as executables (:mod:`spec_decode.executable_store`,
``.../minimax-jax/executables``), which a warm start loads without tracing. Opting out of all three: ``MINIMAX_JAX_COMPILATION_CACHE=0`` in the environment, or
``Engine(..., compilation_cache=False)``. A ``jax_compilation_cache_dir`` the user set is left as it is.
"""

from __future__ import annotations

import os

import jax

__all__ = ["cache_dir", "cost_table_path", "enable", "enabled", "use_directory"]


def cache_dir() -> str:
    """Where the engine keeps compiled programs (see the module docstring)."""
    if os.environ.get("MINIMAX_JAX_CACHE_DIR"):
        return os.environ["MINIMAX_JAX_CACHE_DIR"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "minimax-jax", "jax")


def enabled() -> bool:
    """False when the environment opts out (``MINIMAX_JAX_COMPILATION_CACHE=0``)."""
    return os.environ.get("MINIMAX_JAX_COMPILATION_CACHE", "1").strip().lower() not in ("0", "false", "off", "no")


def cost_table_path(key: str) -> str:
    """The file of the cost table profiled under ``key`` (a digest of what the timings depend on)."""
    base = os.path.join(os.path.dirname(cache_dir()), "cost_tables")
    os.makedirs(base, exist_ok=True)
    return os.path.join(base, f"{key}.json")


def enable(path: str | None = None) -> str | None:
    """Turn the persistent cache on (unless opted out or already configured); returns its directory or None."""
    if not enabled():
        return None
    current = jax.config.jax_compilation_cache_dir
    if current:
        return current
    path = path or cache_dir()
    os.makedirs(path, exist_ok=True)
    use_directory(path)
    return path


def use_directory(path: str | None) -> None:
    """Point JAX's persistent compilation cache at ``path`` (None: off), keeping every program however small or
    quick to compile, and let JAX look again: programs compiled before this call made it decide once whether a
    cache is there (:func:`enable` uses this; so does the test suite's shared cache)."""
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    try:
        from jax._src import compilation_cache as _cc

        _cc.reset_cache()
    except (ImportError, AttributeError):  # another JAX version: the directory applies from its next check
        pass
