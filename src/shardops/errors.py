"""The one error type users see."""


class ShardingError(ValueError, RuntimeError):
    """A sharding problem the user can fix: the message names the op, the layouts and what to do.

    Both a ValueError and a RuntimeError: torch DTensor raises RuntimeError for the same
    problems (meshes that differ, no strategy), so code written for torch catches it too.
    """


class CollectiveError(ShardingError):
    """A collective could not complete: ranks disagreed, a rank failed, or one never arrived."""


# Where torch's DTensor raises another built-in class at the same point, shardops raises a
# ShardingError that is also that class (code written for torch catches it), with torch's
# phrase first in the message and shardops' explanation after it.


class NoShardingStrategyError(ShardingError, NotImplementedError):
    """An op with no sharded strategy that cannot fall back (torch: NotImplementedError,
    "Operator ... does not have a sharding strategy registered.")."""


class LayoutMismatchError(ShardingError, AssertionError):
    """Layouts given to a parallel style that do not pair up (torch: AssertionError)."""
