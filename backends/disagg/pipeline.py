"""How many layers the prefill engine computes before it posts their KV writes.

Short prompts have a high transfer-to-compute ratio, so they are cut into many
groups (up to max_iters) to hide most of the transfer; long prompts are compute
bound and a few groups (min_iters) hide it with less per-write overhead. The
number of groups falls linearly between pipeline_min_tokens and saturation x
that, and the group size is the layer count divided by it, so any depth works.
Below pipeline_min_tokens, and on models of SMALL_MODEL_LAYERS layers or fewer
(where a write per group costs more than the overlap saves), the step writes
its KV once, after the forward. A fixed pipeline_group_size overrides all of
this: what the user set explicitly wins over the heuristics.

The heuristics assume a link faster than the compute. On a link as slow as the
prefill (tests/test_shaped_link.py, README), the exposed transfer is the last group's
and the link idles while a group computes: a 4K prompt measured 0.62x and 0.65x of one
write after the forward with these groups, and 0.52x with `pipeline_group_size` 1
(the limit is 0.5x: the link waits for the first layer, then carries the whole KV).
"""
from __future__ import annotations

from backends.disagg.config import DisaggConfig

SMALL_MODEL_LAYERS = 4


def layer_group_size(num_layers: int, avg_tokens: float, cfg: DisaggConfig) -> int:
    """Layers per group for a step, or 0 to write once after the forward."""
    if cfg.pipeline == "off":
        return 0
    if cfg.pipeline_group_size > 0:
        return min(cfg.pipeline_group_size, num_layers)
    if num_layers <= SMALL_MODEL_LAYERS or avg_tokens < cfg.pipeline_min_tokens:
        return 0
    lo, hi = cfg.pipeline_min_iters, cfg.pipeline_max_iters
    start = max(cfg.pipeline_min_tokens, 1)  # a threshold of 0 pipelines every step; the ramp still needs a width
    t = min(max((avg_tokens - start) / (start * cfg.pipeline_saturation - start), 0.0), 1.0)
    iters = min(max(hi - t * (hi - lo), lo), hi)
    return max(1, int(num_layers // iters))


def layer_groups(num_layers: int, group_size: int) -> list[range]:
    """The layer ranges written together; one range of every layer when group_size is 0."""
    if group_size <= 0:
        return [range(num_layers)]
    return [range(s, min(s + group_size, num_layers)) for s in range(0, num_layers, group_size)]
