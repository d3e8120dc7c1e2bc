"""Ragged metadata on the device (``pallas_kernels.metadata``) against numpy restatements: random row lengths,
zero-length rows, padding slots past the last row."""

import numpy as np
import pytest

from pallas_kernels.metadata import token_to_request


@pytest.mark.parametrize("seed", range(4))
def test_token_to_request_matches_a_loop(seed):
    rng = np.random.default_rng(seed)
    rows = int(rng.integers(1, 12))
    lens = rng.integers(0, 6, rows) * (rng.random(rows) < 0.8)  # some rows empty
    qsl = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    num_tokens = int(qsl[-1] + rng.integers(0, 5))  # padding slots past the last row
    want = np.full(num_tokens, -1, np.int32)
    for r in range(rows):
        want[qsl[r]:qsl[r + 1]] = r
    np.testing.assert_array_equal(np.asarray(token_to_request(qsl, num_tokens)), want)


def test_token_to_request_empty_batch():
    np.testing.assert_array_equal(np.asarray(token_to_request(np.zeros(4, np.int32), 3)), [-1, -1, -1])
