"""The parallel layout of a trainer job: tensor, context (Ulysses x ring), pipeline and data parallel sizes.

Ranks are ordered the Megatron way ("tp-cp-dp-pp"): tensor parallel fastest, then context parallel
(Ulysses fastest inside it, then ring), then data parallel, then pipeline stages. A layout is pure data:
no process group is created here, so it can be validated (and printed by a dry run) without a job.
"""

from __future__ import annotations

from dataclasses import dataclass

# Outermost last: this is the order of `HyperCommGrid` dimensions (fastest-varying first).
GRID_DIMS: tuple[str, ...] = ("tp", "ulysses", "ring", "dp", "pp")


class LayoutError(ValueError):
    """A parallel layout that cannot run: the message names the size that is wrong and why."""


@dataclass(frozen=True)
class ParallelLayout:
    """Sizes of each parallel dimension.

    `cp = ulysses * ring` is the context-parallel size (USP: all-to-all inside, ring attention across).
    `dp=None` means "whatever is left of the world size" and is resolved by `resolve`.
    """

    tp: int = 1
    ulysses: int = 1
    ring: int = 1
    pp: int = 1
    dp: int | None = None

    def __post_init__(self) -> None:
        for name in ("tp", "ulysses", "ring", "pp"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise LayoutError(f"parallel size {name}={value!r} must be a positive integer")
        if self.dp is not None and (not isinstance(self.dp, int) or isinstance(self.dp, bool) or self.dp < 1):
            raise LayoutError(f"parallel size dp={self.dp!r} must be a positive integer or None")

    @property
    def cp(self) -> int:
        """Context-parallel size: Ulysses degree times ring degree."""
        return self.ulysses * self.ring

    @property
    def model_parallel_size(self) -> int:
        """Ranks that hold one replica of the model: tp * cp * pp."""
        return self.tp * self.cp * self.pp

    @property
    def world_size(self) -> int:
        """Total ranks; only defined once dp is known."""
        if self.dp is None:
            raise LayoutError("dp is not resolved yet: call layout.resolve(world_size) first")
        return self.model_parallel_size * self.dp

    def resolve(self, world_size: int) -> ParallelLayout:
        """Return a copy with dp filled in from `world_size`, checking that the sizes divide it."""
        if world_size < 1:
            raise LayoutError(f"world size {world_size} must be positive")
        mp = self.model_parallel_size
        if world_size % mp != 0:
            raise LayoutError(
                f"world size {world_size} is not divisible by tp*ulysses*ring*pp = "
                f"{self.tp}*{self.ulysses}*{self.ring}*{self.pp} = {mp}"
            )
        dp = world_size // mp
        if self.dp is not None and self.dp != dp:
            raise LayoutError(
                f"dp={self.dp} does not match the world size: {world_size} ranks / (tp*cp*pp = {mp}) = {dp}"
            )
        return ParallelLayout(tp=self.tp, ulysses=self.ulysses, ring=self.ring, pp=self.pp, dp=dp)

    def grid_shape(self) -> list[int]:
        """Sizes in `GRID_DIMS` order."""
        return [self.tp, self.ulysses, self.ring, self.world_size // self.model_parallel_size, self.pp]

    def stage_roots(self, first_rank: int = 0) -> list[int]:
        """The global rank of each pipeline stage's first rank in the first replica (tp, cp and dp coordinates 0),
        stage by stage, for a grid whose ranks start at `first_rank`: the ranks that send each stage's weights."""
        first = self.coordinates(0)
        return [first_rank + next(r for r in range(self.world_size) if self.coordinates(r) == {**first, "pp": s})
                for s in range(self.pp)]

    def coordinates(self, rank: int) -> dict[str, int]:
        """This rank's index along each dimension of the grid."""
        if not 0 <= rank < self.world_size:
            raise LayoutError(f"rank {rank} is outside the world of {self.world_size} ranks")
        coords = {}
        for name, size in zip(GRID_DIMS, self.grid_shape()):
            coords[name] = rank % size
            rank //= size
        coords["cp"] = coords["ulysses"] + self.ulysses * coords["ring"]
        return coords

    def validate_model(
        self, *, num_heads: int, num_layers: int, image_tokens: int | None = None, vp: int = 1
    ) -> None:
        """Check that a model splits evenly over this layout (heads over tp*ulysses, layers over pp)."""
        if num_heads % self.tp != 0:
            raise LayoutError(f"attention heads {num_heads} are not divisible by tp={self.tp}")
        if (num_heads // self.tp) % self.ulysses != 0:
            raise LayoutError(
                f"heads per tensor-parallel rank {num_heads // self.tp} are not divisible by "
                f"ulysses={self.ulysses}"
            )
        if num_layers % (self.pp * vp) != 0:
            raise LayoutError(
                f"{num_layers} transformer blocks are not divisible by pp*vp = {self.pp}*{vp} stages"
            )
        if image_tokens is not None and image_tokens % self.cp != 0:
            raise LayoutError(f"{image_tokens} image tokens are not divisible by cp={self.cp}")

    def describe(self) -> str:
        dp = "?" if self.dp is None else str(self.dp)
        return f"tp={self.tp} cp={self.cp} (ulysses={self.ulysses} x ring={self.ring}) pp={self.pp} dp={dp}"
