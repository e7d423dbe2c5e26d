"""Progress bars of :meth:`memagent.agent.loop.MemoryAgent.run` (``progress=True``)."""

from __future__ import annotations


class Bars:
    """Two tqdm bars: samples finished, and turns (one per chunk plus the final one) finished."""

    def __init__(self, n_samples: int):
        from tqdm.auto import tqdm

        self.samples = tqdm(total=n_samples, desc="samples", unit="sample", position=0)
        self.turns = tqdm(total=0, desc="turns", unit="turn", position=1)

    def add_turns(self, n: int) -> None:
        self.turns.total += n
        self.turns.refresh()

    def turn_done(self) -> None:
        self.turns.update(1)

    def sample_done(self, skipped_turns: int) -> None:
        if skipped_turns:  # a failed sample does not run its remaining turns
            self.turns.total -= skipped_turns
        self.samples.update(1)

    def close(self) -> None:
        self.turns.close()
        self.samples.close()
