"""One generation request and its host-side progress (shared by the host loop and the device loop)."""

from __future__ import annotations

import dataclasses
import enum

import numpy as np

from spec_decode.sampling_params import SamplingParams

__all__ = ["Request", "RequestStatus"]


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    PREFILL = "prefill"
    RUNNING = "running"
    FINISHED = "finished"


@dataclasses.dataclass(eq=False)
class Request:
    """One generation request and its host-side progress (compared by identity)."""

    index: int  # position in the caller's prompt list
    prompt: list[int]
    params: SamplingParams
    stop_ids: tuple[int, ...]
    arrival: int  # admission order key (smaller = older)
    status: RequestStatus = RequestStatus.WAITING
    slot: int | None = None
    output: list[int] = dataclasses.field(default_factory=list)
    limit: int = 0  # tokens it may emit in all: max_new_tokens, capped by the engine's max_model_len
    num_cached: int = 0  # tokens in the target cache, as far as the host has read back (plus prefill scheduled)
    prefill_target: list[int] = dataclasses.field(default_factory=list)  # tokens to (re)compute before decoding
    finish_reason: str | None = None
    # statistics
    target_steps: int = 0
    accepted_per_position: np.ndarray | None = None
    verified_per_position: np.ndarray | None = None
    verified_drafts_per_step: list[int] = dataclasses.field(default_factory=list)
    preemptions: int = 0

    @property
    def total_len(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def is_resumed(self) -> bool:
        return bool(self.output)
