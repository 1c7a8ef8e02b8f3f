"""The one error type users see."""


class ShardingError(ValueError):
    """A sharding problem the user can fix: the message names the op, the layouts and what to do."""


class CollectiveError(ShardingError):
    """A collective could not complete: ranks disagreed, a rank failed, or one never arrived."""
