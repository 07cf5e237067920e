"""Atomic, checksummed checkpoints with a `latest` pointer, keep-last-k pruning and fallback on load.

Layout under the checkpoint directory:
    step_00000100/                 one complete checkpoint (DeepSpeed's files + ours)
        mp_rank_*_model_states.pt, *optim_states.pt   DeepSpeed: model, ZeRO optimizer partitions
        trainer_state.json         step, consumed samples/tokens, data position, LR schedule, skipped steps
        config.yaml                the resolved run config
        rng/rank_00000.pt          every rank's python / numpy / torch / CUDA / model-parallel RNG states
        manifest.json              size + sha256 of every other file; written last inside the directory
    latest                         the tag of the newest complete checkpoint, replaced atomically
    .tmp-step_00000200/            a save in progress (removed at the next start)

A save writes into `.tmp-<tag>/<tag>`, checksums it, renames it to `<tag>` and only then rewrites `latest`, so a
kill at any moment leaves the previous checkpoint loadable. Loading verifies the manifest; a missing, partial or
corrupt candidate gives a warning and the next older one is tried.
"""
import hashlib
import json
import os
import random
import shutil

import numpy as np
import torch
import torch.distributed as dist

from megahybrid.errors import UserError

TAG_PREFIX = "step_"
MANIFEST = "manifest.json"
TRAINER_STATE = "trainer_state.json"
TMP_PREFIX = ".tmp-"


def tag_for(step: int) -> str:
    return f"{TAG_PREFIX}{step:08d}"


def rng_state() -> dict:
    from megatron.core import tensor_parallel

    state = {
        "python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    from megatron.core import tensor_parallel

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])
    if torch.cuda.is_available() and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
        os.fsync(f.fileno())
    return digest.hexdigest()


def _list_files(root: str) -> list[str]:
    out = []
    for base, _, files in os.walk(root):
        out += [os.path.relpath(os.path.join(base, f), root) for f in files]
    return sorted(f for f in out if f != MANIFEST)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _all_gather(obj) -> list:
    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _broadcast(obj):
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


class CheckpointManager:
    """Saves and finds checkpoints under `root`; every method is called on all ranks together."""

    def __init__(self, root: str, keep: int, warn=print, hooks=None):
        self.root = root
        self.keep = keep
        self.warn = warn
        # Test hook: called with a stage name ("written") in the middle of a save.
        self.hooks = hooks or (lambda stage, step: None)
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1

    def clean_stale(self) -> None:
        """Remove unfinished saves left by a killed run."""
        if self.rank == 0 and os.path.isdir(self.root):
            for name in os.listdir(self.root):
                if name.startswith(TMP_PREFIX):
                    shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)
        _barrier()

    def save(self, engine, step: int, trainer_state: dict, config_yaml: str) -> str:
        tag = tag_for(step)
        tmp_root = os.path.join(self.root, TMP_PREFIX + tag)
        final = os.path.join(self.root, tag)
        if self.rank == 0:
            shutil.rmtree(tmp_root, ignore_errors=True)
            os.makedirs(tmp_root)
        _barrier()
        engine.save_checkpoint(tmp_root, tag=tag, save_latest=False)
        staged = os.path.join(tmp_root, tag)
        os.makedirs(os.path.join(staged, "rng"), exist_ok=True)
        torch.save(rng_state(), os.path.join(staged, "rng", f"rank_{self.rank:05d}.pt"))
        if self.rank == 0:
            with open(os.path.join(staged, TRAINER_STATE), "w") as f:
                json.dump(trainer_state, f, indent=1)
            with open(os.path.join(staged, "config.yaml"), "w") as f:
                f.write(config_yaml)
        _barrier()
        self.hooks("written", step)
        self._write_manifest(staged, step)
        if self.rank == 0:
            if os.path.isdir(final):
                shutil.rmtree(final)
            os.rename(staged, final)
            # DeepSpeed also drops its zero_to_fp32 scripts beside the tag; they are not part of the checkpoint.
            shutil.rmtree(tmp_root)
            _fsync_dir(self.root)
            self._write_latest(tag)
            self._prune(keep_tag=tag)
        _barrier()
        return final

    def _write_manifest(self, staged: str, step: int) -> None:
        files = _list_files(staged) if self.rank == 0 else None
        files = _broadcast(files)
        mine = {rel: {"size": os.path.getsize(os.path.join(staged, rel)), "sha256": _sha256(os.path.join(staged, rel))}
                for rel in files[self.rank::self.world]}
        entries = {}
        for part in _all_gather(mine):
            entries.update(part)
        if self.rank == 0:
            path = os.path.join(staged, MANIFEST)
            with open(path, "w") as f:
                json.dump({"step": step, "world_size": self.world, "files": entries}, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            _fsync_dir(staged)

    def _write_latest(self, tag: str) -> None:
        tmp = os.path.join(self.root, "latest.tmp")
        with open(tmp, "w") as f:
            f.write(tag + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(self.root, "latest"))
        _fsync_dir(self.root)

    def _prune(self, keep_tag: str) -> None:
        tags = self.tags()
        for tag in tags[:-self.keep]:
            if tag != keep_tag:
                shutil.rmtree(os.path.join(self.root, tag), ignore_errors=True)

    def tags(self) -> list[str]:
        """Checkpoint directories present, oldest first."""
        if not os.path.isdir(self.root):
            return []
        return sorted(n for n in os.listdir(self.root) if n.startswith(TAG_PREFIX) and
                      os.path.isdir(os.path.join(self.root, n)))

    def _candidates(self) -> list[str]:
        """`latest` first, then the others newest first."""
        tags = self.tags()[::-1]
        try:
            with open(os.path.join(self.root, "latest")) as f:
                latest = f.read().strip()
        except OSError:
            latest = None
        if latest and latest not in tags:
            self.warn(f"warning: checkpoint pointer 'latest' names {latest}, which is missing; trying older ones")
        return [latest] + [t for t in tags if t != latest] if latest in tags else tags

    def find_loadable(self) -> str | None:
        """The newest checkpoint whose manifest verifies on every rank, warning about each one skipped."""
        candidates = _broadcast(self._candidates() if self.rank == 0 else None)
        for tag in candidates:
            problem = self._verify(os.path.join(self.root, tag))
            problems = [p for p in _all_gather(problem) if p]
            if not problems:
                return tag
            if self.rank == 0:
                self.warn(f"warning: checkpoint {tag} is unusable ({problems[0]}); falling back to the previous one")
        return None

    def _verify(self, path: str) -> str | None:
        try:
            with open(os.path.join(path, MANIFEST)) as f:
                manifest = json.load(f)
        except (OSError, ValueError):
            return "no valid manifest: the save did not complete"
        items = sorted(manifest.get("files", {}).items())
        if not items:
            return "empty manifest"
        for rel, meta in items[self.rank::self.world]:
            full = os.path.join(path, rel)
            if not os.path.isfile(full):
                return f"{rel} is missing"
            if os.path.getsize(full) != meta["size"]:
                return f"{rel} has the wrong size"
            if _sha256(full) != meta["sha256"]:
                return f"{rel} fails its checksum"
        return None

    def load(self, engine, tag: str, layout: dict) -> dict:
        """Load model + optimizer into `engine`, this rank's RNG states; returns the trainer state.
        The layout (tp/cp/dp) must equal the saving run's: ZeRO partitions and RNG states are per rank."""
        path = os.path.join(self.root, tag)
        with open(os.path.join(path, TRAINER_STATE)) as f:
            state = json.load(f)
        if state.get("layout") != layout:
            raise UserError(
                f"checkpoint {path} was saved with layout {state.get('layout')} but this run has {layout}: resume "
                "with the same layout, or start a new checkpoint.dir with checkpoint.init_from=<that checkpoint> "
                "(weights only; see also megahybrid convert)"
            )
        load_path, _ = engine.load_checkpoint(self.root, tag=tag, load_optimizer_states=True,
                                              load_lr_scheduler_states=False)
        if load_path is None:
            raise UserError(f"checkpoint {path} could not be loaded by DeepSpeed: remove it or pass --no-resume")
        set_rng_state(torch.load(os.path.join(path, "rng", f"rank_{self.rank:05d}.pt"), weights_only=False))
        return state
