"""JAX's persistent compilation cache, on by default for the engine.

``Engine(...)`` calls :func:`enable`: compiled programs (the closed step set, the device loop, their Triton
kernels) are written to ``$MINIMAX_JAX_CACHE_DIR`` or ``$XDG_CACHE_HOME/minimax-jax/jax`` (default
``~/.cache/minimax-jax/jax``), so a second process with the same model and settings loads them instead of
compiling. Small programs are kept too (JAX's default keeps only programs that took a second or more to
compile). Opting out: ``MINIMAX_JAX_COMPILATION_CACHE=0`` in the environment, or ``Engine(...,
compilation_cache=False)``. A ``jax_compilation_cache_dir`` the user set is left as it is.
"""

from __future__ import annotations

import os

import jax

__all__ = ["cache_dir", "enable"]


def cache_dir() -> str:
    """Where the engine keeps compiled programs (see the module docstring)."""
    if os.environ.get("MINIMAX_JAX_CACHE_DIR"):
        return os.environ["MINIMAX_JAX_CACHE_DIR"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "minimax-jax", "jax")


def enable(path: str | None = None) -> str | None:
    """Turn the persistent cache on (unless opted out or already configured); returns its directory or None."""
    if os.environ.get("MINIMAX_JAX_COMPILATION_CACHE", "1").strip().lower() in ("0", "false", "off", "no"):
        return None
    current = jax.config.jax_compilation_cache_dir
    if current:
        return current
    path = path or cache_dir()
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    try:  # programs compiled before this call made JAX decide "no cache" once; let it look again
        from jax._src import compilation_cache as _cc

        if _cc._cache_checked and not _cc._cache_used:
            _cc.reset_cache()
    except (ImportError, AttributeError):  # another JAX version: the cache applies from its next check
        pass
    return path
