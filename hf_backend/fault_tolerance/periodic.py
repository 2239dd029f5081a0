"""Replica groups that meet every N steps (LocalSGD / DiLoCo between the groups): each group steps alone in between,
and at a meeting each group's move since the last one is averaged across the quorum and an outer optimizer steps on
it from the last meeting's weights (lr 1 and no momentum: the average of the weights, LocalSGD). A group that is
behind is healed as a meeting's quorum forms."""

from __future__ import annotations

from typing import Any

import torch

from ..core.notes import note
from .groups import ReplicaGroups
from .settings import FaultTolerance


class Periodic(ReplicaGroups):
    meets_every_step = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.discarded_meetings = 0  # meetings the quorum did not finish
        self._local_steps = 0  # optimizer steps taken
        self._stepped = 0  # optimizers stepped in this step
        self._outer: _OuterStep | None = None  # the weights of the last meeting and the outer optimizer
        self._healed = False  # whether the meeting under way healed this group

    @property
    def committed_steps(self) -> int:
        return self._local_steps

    def commit(self) -> bool:
        """A local step is always applied, but for the first: the groups meet before it (their starting weights
        agree), and a restarted group healed there skips it."""
        if self._outer is None:  # the first meeting
            self._outer, self._healed = _OuterStep(self._trainable(), self.config), False
            self._meet()
            return not self._healed_on_restart()
        return True

    def after_optimizer_step(self) -> None:
        """Once every optimizer has stepped and the count of steps is a multiple of N, the groups meet."""
        self._stepped += 1
        if self._stepped < len(self.objects.optimizers):
            return
        self._stepped = 0
        self._local_steps += 1
        if self._local_steps % self.config.sync_every == 0:
            self._meet()

    stepped = after_optimizer_step

    def _meet(self) -> None:
        """A meeting the quorum does not finish leaves every group at the last meeting's weights."""
        assert self._outer is not None
        self._begin()  # a group that is behind receives a live one's state as the quorum forms
        params = self._trainable()
        moves = self._outer.moves(params)
        self._average(moves)
        if self.manager.should_commit():
            self._outer.step(moves)
            self._note_missing_groups()
        else:
            self.discarded_meetings += 1
            note(f"fault tolerance: the meeting after step {self._local_steps} failed (a replica group failed "
                 f"during it); every group goes back to the weights of the meeting before")
        self._outer.restore(params)

    def _healed_on_restart(self) -> bool:
        """Whether a restarted group was healed at its first meeting: its first step's gradient was then taken on
        the weights the meeting replaced, and is not applied. (On a first start torchft's `init_sync` copies one
        group's starting weights into the others, which are the same weights when the script seeds them.) torchft
        heals each process from its own source, so the group decides together."""
        healed = torch.tensor(float(self._healed and not self._first_start))
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(healed, op=torch.distributed.ReduceOp.MAX)
        return bool(healed.item())

    def _mode_state(self) -> dict[str, Any]:
        outer = self._outer.state_dict() if self._outer is not None else None
        return {"local_steps": self._local_steps, "outer": outer}

    def _load_mode_state(self, state: dict[str, Any]) -> None:
        self._local_steps = state["local_steps"]
        self._healed = True
        if state["outer"] is not None:
            if self._outer is None:
                self._outer = _OuterStep(self._trainable(), self.config)
            self._outer.load_state_dict(state["outer"])


class _OuterStep:
    """The groups' weights at the last meeting (this process's shards) and the outer optimizer that moves them: SGD
    with Nesterov momentum on the averaged move (DiLoCo's outer step; lr 1 and no momentum: the average)."""

    def __init__(self, params: list[torch.Tensor], config: FaultTolerance) -> None:
        self.anchor = [torch.nn.Parameter(p.detach().clone()) for p in params]
        self.optimizer = torch.optim.SGD(self.anchor, lr=config.outer_lr, momentum=config.outer_momentum,
                                         nesterov=config.outer_momentum > 0)

    def moves(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """How far each parameter moved since the last meeting, as a gradient: anchor - now."""
        return [anchor.detach() - p.detach() for anchor, p in zip(self.anchor, params, strict=True)]

    def step(self, moves: list[torch.Tensor]) -> None:
        for anchor, move in zip(self.anchor, moves, strict=True):
            anchor.grad = move
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    @torch.no_grad()
    def restore(self, params: list[torch.Tensor]) -> None:
        for p, anchor in zip(params, self.anchor, strict=True):
            p.copy_(anchor)

    def state_dict(self) -> dict[str, Any]:
        return {"anchor": [a.detach() for a in self.anchor], "optimizer": self.optimizer.state_dict()}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        for mine, theirs in zip(self.anchor, state["anchor"], strict=True):
            mine.copy_(theirs)
        self.optimizer.load_state_dict(state["optimizer"])
