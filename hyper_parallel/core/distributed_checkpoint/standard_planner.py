"""The default planners: what to write from a state dict, where to load into.

:class:`StandardSavePlanner` offers one write item per tensor piece (a whole
tensor, a DTensor shard, a ShardedTensor box) and one bytes item per value;
tensors stay in its cache, never in plans. The coordinator's merge is
:func:`._global_plan.build_global_save_plan`.

:class:`StandardLoadPlanner` reads, for every piece of every target tensor,
the overlap with each stored chunk, straight into the target's memory when the
framework shares it (CPU), otherwise into a staging copy assigned back at the
end. Non-tensor values are replaced in the caller's (nested) dict.

This is the public module; the planners are defined in :mod:`._save_planner`
and :mod:`._load_planner` (one concept per module) and re-exported here as the
same class objects.
"""

from __future__ import annotations

from hyper_parallel.core.distributed_checkpoint._load_planner import StandardLoadPlanner
from hyper_parallel.core.distributed_checkpoint._save_planner import AliasData, StandardSavePlanner

__all__ = ["AliasData", "StandardSavePlanner", "StandardLoadPlanner"]
