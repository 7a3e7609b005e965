"""The batch schedule: which of a client's training samples each local step reads.

A schedule depends only on (seed, round, client, salt) and the batch size, epochs or steps:
not on the backend, the other clients of the call or what ran before. So both backends, and
the hand-written loops of `fedbench/algorithms/_steps.py` (`Engine.batches`), read the same
batches, and a resumed run reads the ones an uninterrupted run does.

Augmentation (`data.augment`) is keyed the same way: a client's random crops and flips in a
call come from a generator seeded by (seed, round, client, salt), row s of its draws for its
batch s (`draws`). Both backends and the hand-written loops crop and flip a client's batch
alike, whatever the order in which they read the clients' batches, and a resume needs no
saved generator state.

Dropout (`fedbench.models.dropout.KeyedDropout`) is keyed the same way: `keys` gives one key
per batch of a client's schedule, from (seed, round, client, salt) on a stream of its own;
each backend enters the key of the batch around the batch's forward, so both drop the same
elements. `full_keys` serves full-gradient passes (one key per block, no round).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch
import torch.nn.functional as F

from fedbench.data.federation import draw_augment
from fedbench.engine.plan import TrainPlan
from fedbench.models.dropout import batch_keys

AUGMENT_KEY = 1  # appended to a schedule's key: the augmentation draws' own stream
DROPOUT_KEY = 2  # appended to a schedule's key: the dropout keys' own stream
FULL_KEY = 3  # a full-gradient pass's dropout keys (seed, client, FULL_KEY)


def _seed(*parts: int) -> int:
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(1)[0])


class Schedule:
    """Batches of the federation's clients: `indices` [S, B] per client, `read` them."""

    def __init__(
        self,
        fed,
        device: torch.device,
        *,
        seed: int = 0,
        drop_last: bool = False,
        dropout: bool = False,
    ):
        self.fed = fed
        self.device = device
        self.seed = seed
        self.drop_last = drop_last
        self.dropout = dropout  # the model has keyed dropout: batches get keys (`keys`)

    def indices(
        self,
        client: int,
        batch_size: int,
        *,
        epochs: int | None = None,
        steps: int | None = None,
        round: int = 0,
        salt: int = 0,
    ) -> tuple[torch.Tensor, list[int]]:
        """Sample indices [S, B] (rows padded with 0) and each row's true length.

        One permutation of the client's data per epoch; `steps` keeps drawing epochs until
        that many batches exist and stops there (pFedHN's inner steps, PLGU-GRep's 1 step).
        """
        pool = self.fed.train_idx[client]
        n = int(pool.numel())
        b = min(batch_size, n)
        per_epoch = n // b if self.drop_last else -(-n // b)
        need = steps if steps is not None else per_epoch * int(epochs or 0)
        if need <= 0 or n == 0:
            return torch.zeros(0, b, dtype=torch.long, device=self.device), []
        g = torch.Generator().manual_seed(_seed(self.seed, round, client, salt))
        n_epochs = -(-need // per_epoch)
        rows, lens = [], []
        for _ in range(n_epochs):
            perm = torch.randperm(n, generator=g)
            for s in range(per_epoch):
                chunk = perm[s * b : (s + 1) * b]
                lens.append(int(chunk.numel()))
                rows.append(F.pad(chunk, (0, b - chunk.numel())))
        pos = torch.stack(rows[:need]).to(self.device)
        return pool[pos], lens[:need]

    def draws(
        self, client: int, shape: tuple[int, ...], *, round: int = 0, salt: int = 0
    ) -> torch.Tensor | None:
        """The augmentation draws [S, B, 3] of a client's schedule `shape` (S, B) (None when
        the federation does not augment): row s crops and flips its batch s."""
        if not getattr(self.fed, "augment", False):
            return None
        g = torch.Generator().manual_seed(_seed(self.seed, round, client, salt, AUGMENT_KEY))
        return draw_augment(g, tuple(shape)).to(self.device)

    def keys(self, client: int, n: int, *, round: int = 0, salt: int = 0) -> torch.Tensor | None:
        """The dropout keys [n] of a client's schedule of n batches (None when the model has
        no keyed dropout): key s for batch s (`fedbench.models.dropout`)."""
        return self._keys(n, self.seed, round, client, salt, DROPOUT_KEY)

    def full_keys(self, client: int, n: int) -> torch.Tensor | None:
        """The dropout keys [n] of a full-gradient pass's n blocks over a client's data: the
        same at every call (one fixed loss function per client, whatever the round)."""
        return self._keys(n, self.seed, client, FULL_KEY)

    def _keys(self, n: int, *parts: int) -> torch.Tensor | None:
        """n dropout keys from the stream seeded by `parts` (None without keyed dropout)."""
        if not self.dropout:
            return None
        k0, k1 = np.random.SeedSequence([int(p) for p in parts]).generate_state(2)
        return batch_keys(int(k0), int(k1), n, self.device)

    def of(self, plan: TrainPlan, client: int) -> tuple[torch.Tensor, list[int]]:
        """The schedule of `client` in a train call."""
        return self.indices(
            client,
            plan.batch_size,
            epochs=plan.epochs,
            steps=plan.steps,
            round=plan.round,
            salt=plan.salt,
        )

    def draws_of(self, plan: TrainPlan, client: int, idx: torch.Tensor) -> torch.Tensor | None:
        """The augmentation draws of `client`'s schedule `idx` in a train call."""
        return self.draws(client, idx.shape, round=plan.round, salt=plan.salt)

    def keys_of(self, plan: TrainPlan, client: int, n: int) -> torch.Tensor | None:
        """The dropout keys of `client`'s n batches in a train call (`keys`)."""
        return self.keys(client, n, round=plan.round, salt=plan.salt)

    def batch(
        self, idx: torch.Tensor, draws: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A training read of samples `idx` (1-D), augmented as `draws` ([len(idx), 3]) say."""
        if draws is None:
            return self.fed.batch(idx)
        return self.fed.batch(idx, draws=draws)

    def read(
        self, idx: torch.Tensor, lens: list[int], draws: torch.Tensor | None = None
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The mini-batches (x, y) of a schedule, in order (augmented as `draws` say)."""
        for s, ln in enumerate(lens):
            yield self.batch(idx[s, :ln], None if draws is None else draws[s, :ln])
