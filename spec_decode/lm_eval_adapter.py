"""EleutherAI's lm-evaluation-harness over the engine: the ``minimax_jax`` model (docs/EVALUATION.md).

``pip install 'minimax-jax[eval]'`` installs ``lm_eval``. The harness finds models in its registry, which this
module fills on import, so run it through this module (the harness's own command line, with the model
registered)::

    python -m spec_decode.lm_eval_adapter --model minimax_jax --model_args pretrained=default \\
        --tasks minimax_heldout_next_line --include_path spec_decode/lm_eval_tasks

or from Python: ``import spec_decode.lm_eval_adapter`` and then ``lm_eval.simple_evaluate(model="minimax_jax",
...)`` (or pass a :class:`MiniMaxJaxLM` object).

* ``loglikelihood``: :meth:`spec_decode.Engine.score` on the prefix token (BOS) + context and the continuation,
  split as the harness splits them (trailing spaces of the context go to the continuation; the pair is encoded
  whole and cut at the context's length);
* ``loglikelihood_rolling``: the harness's rolling windows of ``max_model_len - 2`` tokens, scored the same way;
* ``generate_until``: :meth:`spec_decode.Engine.generate`, greedy unless the task samples; ``until`` strings are
  the requests' ``SamplingParams.stop``, so a request stops at the first of them (or EOS, or ``max_gen_toks``) and
  its text is cut before the match.
"""

from __future__ import annotations

import os

from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from spec_decode.engine import Engine
from spec_decode.request import encode_prompt
from spec_decode.sampling_params import SamplingParams

__all__ = ["MiniMaxJaxLM", "cut_at_stop", "split_pair"]

_DTYPES = ("bfloat16", "float32")


def split_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """The harness's split of a (context, continuation) pair: trailing whitespace of the context moves to the
    continuation, the whole is encoded at once and cut at the context's encoded length (no BOS)."""
    n = len(context) - len(context.rstrip())
    if n:
        context, continuation = context[:-n], context[-n:] + continuation
    whole = list(tokenizer.encode(context + continuation))
    ctx = list(tokenizer.encode(context)) if context else []
    return whole[:len(ctx)], whole[len(ctx):]


def cut_at_stop(text: str, until) -> str:
    """``text`` up to the first occurrence of any of ``until`` (a string or a list of strings)."""
    stops = [until] if isinstance(until, str) else list(until or ())
    cut = len(text)
    for s in stops:
        if s:
            i = text.find(s)
            if 0 <= i < cut:
                cut = i
    return text[:cut]


def _load(pretrained: str, drafter: str | None, dtype: str):
    """(target, drafter or None, tokenizer) from a checkpoint directory, or the embedded default."""
    import jax.numpy as jnp

    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {_DTYPES}, got {dtype!r}")
    dt = jnp.bfloat16 if dtype == "bfloat16" else jnp.float32
    if pretrained == "default":
        from minimax_jax.default import load_default

        return load_default(dtype=dt)
    from minimax_jax.checkpoint import load_model
    from minimax_jax.drafter_checkpoint import load_drafter
    from minimax_jax.tokenizer import load_tokenizer

    if not os.path.isdir(pretrained):
        raise ValueError(f"pretrained must be a checkpoint directory or 'default', got {pretrained!r}")
    target = load_model(pretrained, dtype=dt)
    d = load_drafter(drafter, target, dtype=dt) if drafter else None
    return target, d, load_tokenizer(pretrained)


@register_model("minimax_jax")
class MiniMaxJaxLM(LM):
    """An ``lm_eval`` model over a speculative :class:`~spec_decode.Engine`.

    ``--model_args``: ``pretrained`` (a checkpoint directory with its ``tokenizer.json``, or ``default``: the
    embedded default with its drafter), ``drafter`` (a drafter directory for a checkpoint), ``verification``
    (``adaptive`` / ``fixed`` / ``none``; default adaptive with a drafter, else none),
    ``num_speculative_tokens`` (7), ``max_num_seqs`` (16), ``max_model_len``, ``max_gen_toks`` (256: the default
    when a task gives none), ``dtype`` (``bfloat16`` / ``float32``). ``batch_size`` and ``device`` from the
    harness's command line are accepted and unused (the engine batches continuously, on JAX's default device).
    ``engine=`` (Python only) wraps an existing engine, which needs a tokenizer.
    """

    def __init__(self, pretrained: str = "default", drafter: str | None = None, verification: str | None = None,
                 num_speculative_tokens: int = 7, max_num_seqs: int = 16, max_model_len: int | None = None,
                 max_gen_toks: int = 256, dtype: str = "bfloat16", engine: Engine | None = None,
                 batch_size=None, max_batch_size=None, device=None, **engine_kwargs):
        super().__init__()
        if engine is None:
            target, d, tokenizer = _load(str(pretrained), drafter, str(dtype))
            mode = verification or ("adaptive" if d is not None else "none")
            engine = Engine(target, d if mode != "none" else None, verification=mode,
                            num_speculative_tokens=int(num_speculative_tokens), max_num_seqs=int(max_num_seqs),
                            max_model_len=None if max_model_len is None else int(max_model_len),
                            tokenizer=tokenizer, **engine_kwargs)
        if engine.tokenizer is None:
            raise ValueError("the lm_eval adapter needs an engine with a tokenizer (tasks pass text)")
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.max_gen_toks = int(max_gen_toks)
        tok = self.tokenizer
        prefix = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
        if prefix is None:
            raise ValueError("the tokenizer has neither BOS nor EOS: nothing to condition an empty context on")
        self.prefix_token_id = int(prefix)

    @property
    def max_length(self) -> int:
        return self.engine.max_model_len

    # ------------------------------------------------------------------ scoring
    def _score(self, pairs: list[tuple[list[int], list[int]]]):
        """Engine.score on token pairs, contexts cut from the left so each pair fits ``max_model_len - 1``."""
        room = self.max_length - 1
        prompts, conts = [], []
        for ctx, cont in pairs:
            if len(cont) >= room:
                raise ValueError(f"a continuation of {len(cont)} tokens does not fit max_model_len "
                                 f"{self.max_length} with its context")
            prompts.append(ctx[-(room - len(cont)):])
            conts.append(cont)
        return self.engine.score(prompts, conts, progress=False) if pairs else []

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        pairs = []
        for req in requests:
            context, continuation = req.args[:2]
            ctx, cont = split_pair(self.tokenizer, context, continuation)
            pairs.append(([self.prefix_token_id] + ctx, cont))
        out = []
        for (req, r) in zip(requests, self._score(pairs)):
            res = (r.logprob, r.greedy)
            self.cache_hook.add_partial("loglikelihood", req.args, res)
            out.append(res)
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows, owner = [], []
        for i, req in enumerate(requests):
            tokens = list(self.tokenizer.encode(req.args[0]))
            for w in get_rolling_token_windows(tokens, self.prefix_token_id, self.max_length - 2, 1):
                windows.append(make_disjoint_window(w))
                owner.append(i)
        totals = [0.0] * len(requests)
        for i, r in zip(owner, self._score(windows)):
            totals[i] += r.logprob
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    # ------------------------------------------------------------------ generation
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        prompts, params, untils = [], [], []
        for req in requests:
            context, kwargs = req.args[:2]
            kwargs = dict(kwargs or {})
            until = kwargs.pop("until", None)
            n = int(kwargs.pop("max_gen_toks", self.max_gen_toks))
            temperature = float(kwargs.pop("temperature", 0.0)) if kwargs.pop("do_sample", True) else 0.0
            ids = encode_prompt(self.tokenizer, context)
            n = max(1, min(n, self.max_length - 2))
            ids = ids[-(self.max_length - 1 - n):]  # the context cut from the left to leave room for n tokens
            prompts.append(ids)
            stops = [until] if isinstance(until, str) else list(until or ())
            params.append(SamplingParams(max_new_tokens=n, temperature=temperature,
                                         top_p=float(kwargs.pop("top_p", 1.0)), top_k=int(kwargs.pop("top_k", 0)),
                                         seed=int(kwargs.pop("seed", 0)), stop=tuple(x for x in stops if x)))
            untils.append(until)
        if not prompts:
            return []
        results = self.engine.generate(prompts, sampling_params=params, progress=False)
        out = []
        for req, r, until in zip(requests, results, untils):
            # the engine stopped at the first stop string and cut its text there; the host cut is a no-op then
            text = cut_at_stop(r.text if r.text is not None else self.tokenizer.decode(r.token_ids), until)
            self.cache_hook.add_partial("generate_until", req.args, text)
            out.append(text)
        return out


def main(argv=None) -> None:
    """The harness's command line with ``minimax_jax`` registered (``python -m spec_decode.lm_eval_adapter``)."""
    import sys

    from lm_eval.__main__ import cli_evaluate

    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    cli_evaluate()


if __name__ == "__main__":
    main()
