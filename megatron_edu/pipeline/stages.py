"""Where each stage of a pipeline lives, and the messages between stages (2104.04473 §2.2).

p·v *virtual stages* run on p pipeline ranks, v model chunks each. One ``StageMap``, carried by
every schedule, places them, so the checker, simulator, engine, generation, tied embedding and
memory model cannot disagree:

* ``"interleaved"`` (§2.2.2): chunk c of rank r is stage c·p + r, so messages wrap from rank
  p − 1 to rank 0 (v = 1: rank r holds stage r);
* ``"v"`` (2401.10241 §6, ZB-V): odd chunks run back up the ranks (chunk 1 of rank r is stage
  2p − 1 − r), so rank 0 holds the first and last stage, and stage p − 1 hands its output to
  stage p on its own rank: a *local* message.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["StageMap", "Message"]

PLACEMENTS = ("interleaved", "v")


@dataclass(frozen=True)
class Message:
    """An activation for virtual stage ``stage`` ("act"), or the gradient of its output ("grad")."""

    kind: str        # "act" | "grad"
    microbatch: int
    stage: int       # the virtual stage that receives it


@dataclass(frozen=True)
class StageMap:
    """p pipeline ranks holding v model chunks each, placed ``kind`` ("interleaved" or "v")."""

    p: int
    v: int
    kind: str

    def __post_init__(self) -> None:
        for name in ("p", "v"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"a stage map needs {name} ≥ 1, got {value!r}")
        if self.kind not in PLACEMENTS:
            raise ValueError(f"unknown placement {self.kind!r}; choose one of {PLACEMENTS}")

    @classmethod
    def plain(cls, p: int) -> StageMap:
        """One chunk per rank: rank r holds stage r."""
        return cls(p, 1, "interleaved")

    @property
    def num_stages(self) -> int:
        return self.p * self.v

    def stage(self, rank: int, chunk: int) -> int:
        """The virtual stage that chunk ``chunk`` of pipeline rank ``rank`` holds."""
        if not (0 <= rank < self.p and 0 <= chunk < self.v):
            raise ValueError(f"rank {rank}, chunk {chunk} is outside p = {self.p}, v = {self.v}")
        turned = self.kind == "v" and chunk % 2 == 1     # ZB-V: odd chunks run back up
        return chunk * self.p + (self.p - 1 - rank if turned else rank)

    def location(self, stage: int) -> tuple[int, int]:
        """(rank, chunk) holding virtual stage ``stage``: the inverse of ``stage``."""
        if not 0 <= stage < self.num_stages:
            raise ValueError(f"stage {stage} is outside 0..{self.num_stages - 1}")
        chunk, offset = divmod(stage, self.p)
        turned = self.kind == "v" and chunk % 2 == 1
        return (self.p - 1 - offset if turned else offset), chunk

    @property
    def ends(self) -> tuple[int, int]:
        """The ranks of the first and last stage: the tied embedding's (``embedding_ranks``)."""
        return self.first_rank, self.last_rank

    @property
    def first_rank(self) -> int:
        """The pipeline rank of stage 0: it embeds the token ids."""
        return self.location(0)[0]

    @property
    def last_rank(self) -> int:
        """The pipeline rank of the last stage: it computes the loss (rank 0 under ZB-V)."""
        return self.location(self.num_stages - 1)[0]

    def layers(self, stage: int, num_layers: int) -> range:
        """The global indices of the blocks of ``stage``: the stage-th of p·v equal runs."""
        if num_layers % self.num_stages:
            raise ValueError(f"num_layers = {num_layers} is not divisible by the {self.num_stages} "
                             f"virtual stages (pp·v = {self.p}·{self.v}): every stage holds the "
                             "same number of layers")
        per_stage = num_layers // self.num_stages
        self.location(stage)  # rejects a stage outside the map
        return range(stage * per_stage, (stage + 1) * per_stage)

    def sender(self, message: Message) -> int:
        """The pipeline rank that sends ``message``: its stage's predecessor (act) or successor."""
        return self.location(message.stage + (-1 if message.kind == "act" else 1))[0]

    def receiver(self, message: Message) -> int:
        return self.location(message.stage)[0]

    def is_local(self, message: Message) -> bool:
        """Whether ``message`` stays on its rank: ZB-V's turn between stages p − 1 and p."""
        return self.sender(message) == self.receiver(message)
