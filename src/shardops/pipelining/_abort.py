"""A pipeline step that fails on one rank raises on every rank at once, not after the process group's timeout.

Under torch.distributed (gloo) nothing wakes a rank blocked in a receive when its peer raises: the
wait ends only when the connection drops or the timeout passes (on torch 2.13, with a send pending,
the process group's abort() and shutdown() block and destroy_process_group() leaves the connections
open). So the failing rank leaves its error under a key in the default store, and every receive of
a step, while it waits, looks at that key every `CHECK_EVERY` seconds: a peer raises a
CollectiveError quoting the first failure within about that time. The key names the group and a
per-group step count, which every rank of the group computes alike.

In the threads world `so.run` already fails every waiting rank when one raises; waits there block.
"""

from __future__ import annotations

import itertools
import threading
from collections import defaultdict
from collections.abc import Iterator

from ..comm.base import Group, P2PWork
from ..errors import CollectiveError
from ..world import in_threads_world

CHECK_EVERY = 0.25  # seconds between looks at the store while a receive waits
_steps: defaultdict[tuple[int, ...], Iterator[int]] = defaultdict(itertools.count)  # per group: steps so far


class StepGuard:
    """One step's failure flag: `fail` raises it, `wait` waits for a receive unless it is raised."""

    def __init__(self, group: Group, schedule: str) -> None:
        self.schedule = schedule
        self.key = f"shardops/pipeline/{'-'.join(map(str, group.ranks))}/step{next(_steps[group.ranks])}"
        self._store = None
        if not in_threads_world():
            from .._torch.distributed import default_store

            self._store = default_store()

    def fail(self, message: str) -> None:
        """Tell every rank of the group this step failed (the first failure's message is kept)."""
        if self._store is None:
            return
        try:
            self._store.compare_set(self.key, "", message)  # set only where nobody has yet
        except Exception:  # noqa: BLE001 - the store is gone too: the peers fall back to the timeout
            pass

    def wait(self, work: P2PWork, what: str) -> None:
        """Wait for `work` (a receive, described by `what`); raise a CollectiveError once a peer's step failed.

        gloo's works never report completion before a wait, so a helper thread waits and this one watches the
        flag meanwhile; when the flag wins, the helper stays blocked until the process group goes."""
        if self._store is None:
            work.wait()
            return
        done, failure = threading.Event(), []

        def wait_for_it() -> None:
            try:
                work.wait()
            except BaseException as e:  # noqa: BLE001 - re-raised on the step's thread
                failure.append(e)
            finally:
                done.set()

        threading.Thread(target=wait_for_it, name="shardops-pipeline-recv", daemon=True).start()
        while not done.wait(CHECK_EVERY):
            self._raise_if_failed(what)
        if failure:
            raise failure[0]

    def _raise_if_failed(self, what: str) -> None:
        assert self._store is not None  # only polled under torch.distributed
        if self._store.check([self.key]):
            cause = self._store.get(self.key).decode(errors="replace")
            raise CollectiveError(
                f"{self.schedule}.step: {what} was abandoned: another rank's step failed ({cause}); every rank "
                "of the pipeline raises"
            )
