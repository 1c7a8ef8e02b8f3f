"""The one error type users see."""


class ShardingError(ValueError, RuntimeError):
    """A sharding problem the user can fix: the message names the op, the layouts and what to do.

    Both a ValueError and a RuntimeError: torch DTensor raises RuntimeError for the same
    problems (meshes that differ, no strategy), so code written for torch catches it too.
    """


class CollectiveError(ShardingError):
    """A collective could not complete: ranks disagreed, a rank failed, or one never arrived."""
