"""Deterministic, resumable micro-batch loader over a map-style dataset (a megatron GPT/Blended dataset).

Sample order follows megatron's pretraining sampler: the dataset (already shuffled by its seed) is read in
order; each step of `micro_batch_size * dp_size` consecutive samples is cut into one micro-batch per DP rank,
rank r taking the r-th slice. The only state is `consumed_samples`, counted over all DP ranks, so a run resumed
from `state_dict()` reads exactly the samples the uninterrupted run would have read, on any DP size whose
`micro_batch_size * dp_size` divides the saved position.
"""
from collections.abc import Iterator

import torch

from megahybrid.errors import DataError

Batch = dict[str, torch.Tensor]


class MicroBatchLoader:
    """Yields this DP rank's micro-batches {"tokens", "labels": int64 [b, s], "loss_mask": float32 [b, s]}.

    dataset: map-style, `len()` samples, each a dict with "tokens", "labels", "loss_mask" tensors [s].
    global_batch_size: samples per optimizer step over all DP ranks; a multiple of micro_batch_size * dp_size.
    num_workers: DataLoader processes that prefetch reads; order and content do not depend on it.
    pin_memory: batches in page-locked memory (for a GPU: a copy to the device from pageable memory is staged by
    the driver, which may first wait for the device's queue to drain; from pinned memory a non_blocking copy is
    queued like a kernel).
    Iteration stops before the first global batch that does not fit entirely in the dataset.
    """

    def __init__(
        self,
        dataset,
        global_batch_size: int,
        micro_batch_size: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        consumed_samples: int = 0,
        num_workers: int = 0,
        pin_memory: bool = False,
    ):
        if micro_batch_size < 1 or dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise DataError(
                f"loader: micro_batch_size={micro_batch_size}, dp_rank={dp_rank}, dp_size={dp_size}: need "
                "micro_batch_size >= 1 and 0 <= dp_rank < dp_size"
            )
        if global_batch_size < 1 or global_batch_size % (micro_batch_size * dp_size):
            raise DataError(
                f"global_batch_size {global_batch_size} is not a multiple of micro_batch_size * dp_size = "
                f"{micro_batch_size * dp_size}: change one of them"
            )
        self.dataset = dataset
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.num_workers, self.pin_memory = num_workers, pin_memory
        self.consumed_samples = 0
        self._set_position(consumed_samples)

    @property
    def samples_per_micro_step(self) -> int:
        """Samples consumed over all DP ranks by one micro-batch on each rank."""
        return self.micro_batch_size * self.dp_size

    @property
    def num_micro_batches(self) -> int:
        """Micro-batches per rank per optimizer step (the gradient accumulation steps)."""
        return self.global_batch_size // self.samples_per_micro_step

    def __len__(self) -> int:
        """Micro-batches this rank still yields from the current position."""
        end = len(self.dataset) // self.global_batch_size * self.global_batch_size
        return max(0, end - self.consumed_samples) // self.samples_per_micro_step

    def state_dict(self) -> dict:
        return {"consumed_samples": self.consumed_samples, "global_batch_size": self.global_batch_size}

    def load_state_dict(self, state: dict) -> None:
        self._set_position(int(state["consumed_samples"]))

    def __iter__(self) -> Iterator[Batch]:
        """Yield from the current position; `consumed_samples` counts each batch once it has been yielded."""
        starts = range(self.consumed_samples, self.consumed_samples + len(self) * self.samples_per_micro_step,
                       self.samples_per_micro_step)
        index_lists = [self._rank_indices(start) for start in starts]
        for batch in self._read(index_lists):
            self.consumed_samples += self.samples_per_micro_step
            yield batch

    def _rank_indices(self, step_start: int) -> list[int]:
        first = step_start + self.dp_rank * self.micro_batch_size
        return list(range(first, first + self.micro_batch_size))

    def _read(self, index_lists: list[list[int]]) -> Iterator[Batch]:
        if self.num_workers == 0:
            for indices in index_lists:
                batch = collate([self.dataset[i] for i in indices])
                yield {k: v.pin_memory() for k, v in batch.items()} if self.pin_memory else batch
            return
        loader = torch.utils.data.DataLoader(
            self.dataset, batch_sampler=index_lists, num_workers=self.num_workers, collate_fn=collate,
            pin_memory=self.pin_memory,
        )
        yield from loader

    def _set_position(self, consumed_samples: int) -> None:
        if consumed_samples < 0 or consumed_samples % self.samples_per_micro_step:
            raise DataError(
                f"loader: consumed_samples {consumed_samples} is not a multiple of micro_batch_size * dp_size = "
                f"{self.samples_per_micro_step}: resume with the batch layout the checkpoint was saved with"
            )
        self.consumed_samples = consumed_samples


def collate(samples: list[dict]) -> Batch:
    """Stack per-sample tensors into [b, s] int64 tokens/labels and float32 loss_mask."""
    return {
        "tokens": torch.stack([s["tokens"] for s in samples]).long(),
        "labels": torch.stack([s["labels"] for s in samples]).long(),
        "loss_mask": torch.stack([s["loss_mask"] for s in samples]).float(),
    }
