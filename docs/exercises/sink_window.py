"""Exercise (docs/own-variant.md): attention sinks and a sliding window, as your own variant.

StreamingLLM keeps the first few tokens of a sequence (the "attention sinks") visible to every
later query, plus a causal window of the most recent keys.  Write the two functions that
``numba_flash.forward`` calls (docs/own-variant.md):

* ``mask_mod``: query ``q_idx`` sees key ``kv_idx`` if the key is not in its future and is either
  one of the first ``params[0]`` keys (the sinks) or one of the ``params[1]`` keys that end at
  the query (``q_idx - params[1] < kv_idx``);
* ``score_mod``: each head ``h`` divides its scores by its own temperature ``temp[h]``.

Both receive the aux tensors ``temp`` (float32 ``[H]``) and ``params`` (int32 ``[2]``).
``Nq == Nk`` here, so ``q_idx`` is the query's position.

Check: ``python -m pytest -n 0 docs/exercises/test_sink_window.py --exercises`` (it runs the
kernel with your functions against a reference built from the rule, not from your functions).
"""

from __future__ import annotations


def mask_mod(b, h, q_idx, kv_idx, temp, params):
    return True  # TODO


def score_mod(score, b, h, q_idx, kv_idx, temp, params):
    return score  # TODO
