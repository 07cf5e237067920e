"""The parallel layout: an explicit, validated description of how ranks are split (torchtitan ParallelDims style).

Megatron's rank order is tp (fastest) -> cp -> dp -> pp. The layout holds sizes only; process groups are created
from it by `megahybrid.distributed.init_distributed`, the one module that touches megatron's `parallel_state`.
"""
from dataclasses import dataclass

from megahybrid.errors import LayoutError


@dataclass(frozen=True)
class ParallelLayout:
    tp: int = 1
    cp: int = 1
    dp: int = 1
    pp: int = 1
    sequence_parallel: bool = False

    def __post_init__(self):
        for name in ("tp", "cp", "dp", "pp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise LayoutError(f"parallel.{name}={value!r} must be a positive integer")
        if self.pp != 1:
            raise LayoutError(f"parallel.pp={self.pp}: pipeline parallelism is not supported yet; set pp=1")
        if self.sequence_parallel and self.tp == 1:
            raise LayoutError("parallel.sequence_parallel needs tp > 1; set sequence_parallel=false or raise tp")

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    @classmethod
    def for_world(cls, world_size: int, tp: int = 1, cp: int = 1, pp: int = 1, sequence_parallel: bool = False):
        """Derive dp from the world size; raise if tp * cp * pp does not divide it."""
        model_parallel = tp * cp * pp
        if model_parallel < 1 or world_size % model_parallel:
            raise LayoutError(
                f"world size {world_size} is not divisible by tp*cp*pp = {tp}*{cp}*{pp}; "
                "launch a multiple of that many ranks or change tp/cp/pp"
            )
        return cls(tp=tp, cp=cp, dp=world_size // model_parallel, pp=pp, sequence_parallel=sequence_parallel)

    def check_world(self, world_size: int) -> None:
        if self.world_size != world_size:
            raise LayoutError(
                f"parallel layout tp*cp*dp*pp = {self.tp}*{self.cp}*{self.dp}*{self.pp} = {self.world_size} "
                f"but {world_size} ranks were launched; launch {self.world_size} ranks or change the layout"
            )

    def check_model(self, num_heads: int, num_kv_heads: int, seq_length: int, chunk_size: int = 1) -> None:
        """Head counts must split over tp; the sequence over cp in whole mixer chunks."""
        if num_heads % self.tp:
            raise LayoutError(f"model.num_heads={num_heads} is not divisible by tp={self.tp}; choose tp dividing it")
        if num_kv_heads % self.tp:
            raise LayoutError(
                f"model.num_kv_heads={num_kv_heads} is not divisible by tp={self.tp}; choose tp dividing it"
            )
        unit = chunk_size * self.cp  # contiguous CP shards of whole mixer chunks (megahybrid.model.cp)
        if seq_length % unit:
            raise LayoutError(
                f"model.seq_length={seq_length} must be a multiple of {unit} (mixer chunk {chunk_size} x cp {self.cp})"
                "; change seq_length or cp"
            )
        if self.sequence_parallel and seq_length % (self.tp * self.cp):
            raise LayoutError(f"model.seq_length={seq_length} must be divisible by tp*cp for sequence parallelism")
