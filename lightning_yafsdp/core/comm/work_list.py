"""Several async works waited as one, then a step of our own.

One class for every kind of work the engine waits as one: a unit's trainable and
frozen gathers, a row chunk's pieces ([Note: row chunks]), and the sends and
receives of a pairwise exchange on gloo ([Note: pairwise exchanges on gloo]).
"""

from __future__ import annotations

from collections.abc import Callable


class WorkList:
    """Async works (``None`` entries: nothing to wait) waited as one.

    ``then`` runs once, right after the last wait (the sum of a pairwise reduction; a
    row chunk's copy-out of its reduced pieces).
    """

    # [Note: unwaited works are kept]
    # Works of a list dropped before its wait (an exception between issue and wait):
    # gloo's transport thread holds only a weak pointer to a send or receive, and one
    # freed early leaves the peer's matching transfer stuck, and every later one on
    # that group. So they are kept, as gloo's workers keep an unwaited collective
    # running, until exit. A class attribute: it outlives the module's globals at exit.
    unwaited_works: list = []

    def __init__(self, works: list, then: Callable[[], None] | None = None) -> None:
        self.works = works
        self._then = then

    def __del__(self) -> None:
        if self.works:  # never waited: keep the transfers alive (see the Note)
            type(self).unwaited_works.extend(w for w in self.works if w is not None)

    def is_completed(self) -> bool:
        return all(work is None or work.is_completed() for work in self.works)

    def wait(self) -> None:
        for work in self.works:
            if work is not None:
                work.wait()
        self.works = []
        then, self._then = self._then, None
        if then is not None:
            then()
