"""Atomic, checksummed checkpoints with a `latest` pointer, keep-last-k pruning and fallback on load.

Layout under the checkpoint directory:
    step_00000100/                 one complete checkpoint (DeepSpeed's files + ours)
        mp_rank_*_model_states.pt, *optim_states.pt   DeepSpeed: model, ZeRO optimizer partitions
        trainer_state.json         step, consumed samples/tokens, data position, LR schedule, skipped steps
        config.yaml                the resolved run config
        rng/rank_00000.pt          every rank's python / numpy / torch / CUDA / model-parallel RNG states (tensors and
                                   plain numbers only)
        manifest.json              size + sha256 of every other file; written last inside the directory
    latest                         the tag of the newest complete checkpoint, replaced atomically
    .tmp-step_00000200/            a save in progress (removed at the next start)

A save writes into `.tmp-<tag>/<tag>`, checksums it, renames it to `<tag>` and only then rewrites `latest`, so a
kill at any moment leaves the previous checkpoint loadable. Loading verifies the manifest; a missing, partial or
corrupt candidate gives a warning and the next older one is tried.

Every file is read with `torch.load(weights_only=True)`: tensors, numbers, strings and containers, plus the four
DeepSpeed classes in DEEPSPEED_GLOBALS. A file that names any other Python object is refused before anything in it
is constructed (the manifest only catches accidents: whoever can write the checkpoint can rewrite it too).

megatron and DeepSpeed are imported inside the functions that need them (each takes seconds to import).
"""
import dataclasses
import hashlib
import json
import os
import pickle
import random
import shutil
import time

import numpy as np
import torch
import torch.distributed as dist
import yaml

from megahybrid.errors import UserError
from megahybrid.model.config import NOT_IN_WEIGHTS, preset
from megahybrid.train.config import from_dict

TAG_PREFIX = "step_"
MANIFEST = "manifest.json"
TRAINER_STATE = "trainer_state.json"
TMP_PREFIX = ".tmp-"


def tag_for(step: int) -> str:
    return f"{TAG_PREFIX}{step:08d}"


def rng_state() -> dict:
    """All RNG states as tensors and plain numbers, so that `weights_only=True` can read them back."""
    from megatron.core import tensor_parallel

    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {
        "python": random.getstate(), "torch": torch.get_rng_state(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "gauss": float(gauss)},
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    from megatron.core import tensor_parallel

    random.setstate(state["python"])
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    torch.set_rng_state(state["torch"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])
    if torch.cuda.is_available() and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])


def deepspeed_globals() -> list:
    """The only classes DeepSpeed 0.19 pickles into the model and ZeRO files we load (ZeRO 1-3, fp32/bf16)."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [ZeroStageEnum, LossScaler, DynamicLossScaler, fragment_address]


def safe_load(path: str, map_location=None):
    """torch.load with weights_only=True and the DeepSpeed allow-list; any other global is a one-line UserError."""
    try:
        with torch.serialization.safe_globals(deepspeed_globals()):
            return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError:
        allowed = {f"{g.__module__}.{g.__qualname__}" for g in deepspeed_globals()}
        names = [n for n in torch.serialization.get_unsafe_globals_in_checkpoint(path) if n not in allowed]
        found = ", ".join(names) or "see torch.load"
        raise UserError(
            f"checkpoint file {path} refers to Python objects a checkpoint may not contain ({found}); "
            "it was not loaded (README 'Checkpoints'): use a checkpoint from a trusted run, or pass --no-resume"
        ) from None


def safe_checkpoint_engine(config_params):
    """DeepSpeed's torch checkpoint engine with every load going through `safe_load`."""
    from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine

    class SafeTorchCheckpointEngine(TorchCheckpointEngine):
        def load(self, path: str, map_location=None):
            return safe_load(path, map_location=map_location)

    return SafeTorchCheckpointEngine(config_params)


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
        os.fsync(f.fileno())
    return digest.hexdigest()


def _write_failure(root: str, err: Exception) -> str | None:
    """Why a save failed when the directory refuses writes (torch.save reports that as a RuntimeError, so a 1 MiB
    probe decides); None for any other error."""
    if isinstance(err, OSError):
        return err.strerror or str(err)
    probe = os.path.join(root, f".probe-{os.getpid()}")
    try:
        with open(probe, "wb") as f:
            f.write(bytes(1 << 20))
            f.flush()
            os.fsync(f.fileno())
    except OSError as probe_err:
        return probe_err.strerror or str(probe_err)
    finally:
        if os.path.exists(probe):
            os.remove(probe)
    return None


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


def all_gather(obj) -> list:
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


def _dotted(fields: dict, prefix: str = "") -> dict:
    """A model config's fields with the option sections' fields as "section.field"."""
    out = {}
    for k, v in fields.items():
        out.update(_dotted(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


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
        # Checkpoints this run may replace or prune: the ones it wrote or verified; never the unusable ones.
        self.unusable: set[str] = set()

    def clean_stale(self) -> None:
        """Remove unfinished saves left by a killed run."""
        if self.rank == 0 and os.path.isdir(self.root):
            for name in os.listdir(self.root):
                if name.startswith(TMP_PREFIX):
                    shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)
        _barrier()

    def save(self, engine, step: int, trainer_state: dict, config_yaml: str) -> str:
        """Save step `step`; a failing write (full disk, ...) is one UserError, the previous checkpoint intact."""
        try:
            return self._save(engine, step, trainer_state, config_yaml)
        except (OSError, RuntimeError) as err:
            reason = _write_failure(self.root, err)
            if reason is None:
                raise
            shutil.rmtree(os.path.join(self.root, TMP_PREFIX + tag_for(step)), ignore_errors=True)
            previous = self.tags()
            raise UserError(
                f"saving checkpoint {tag_for(step)} in {self.root} failed ({reason}); "
                f"{previous[-1] + ' and latest are' if previous else 'no earlier checkpoint is'} intact: "
                "free space (or fix the directory) and resume") from None

    def _save(self, engine, step: int, trainer_state: dict, config_yaml: str) -> str:
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
                self._set_aside(tag)
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
        for part in all_gather(mine):
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

    def _set_aside(self, tag: str) -> None:
        """An older run's checkpoint under the tag being saved: renamed (not deleted) when it was unusable."""
        if tag not in self.unusable:
            shutil.rmtree(os.path.join(self.root, tag))
            return
        aside = os.path.join(self.root, f"unusable-{tag}-{int(time.time())}")
        os.rename(os.path.join(self.root, tag), aside)
        self.warn(f"warning: the unusable checkpoint {tag} was moved to {aside} (kept for you to inspect or delete)")

    def _prune(self, keep_tag: str) -> None:
        tags = [t for t in self.tags() if t not in self.unusable]
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
            problems = [p for p in all_gather(problem) if p]
            if not problems:
                return tag
            self.unusable.add(tag)
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

    def check_model(self, tag: str, model) -> None:
        """Refuse, before loading, a checkpoint whose model differs from this run's (names every field)."""
        path = os.path.join(self.root, tag, "config.yaml")
        with open(path) as f:
            saved_cfg = from_dict(yaml.safe_load(f))
        saved = _dotted(dataclasses.asdict(preset(saved_cfg.model.preset, **saved_cfg.model.overrides)))
        ours = _dotted(dataclasses.asdict(model))
        changed = [f"model.{k} {saved[k]} -> {ours.get(k)}" for k in saved
                   if k not in NOT_IN_WEIGHTS and saved[k] != ours.get(k)]
        if changed:
            raise UserError(
                f"checkpoint {os.path.join(self.root, tag)} holds another model ({', '.join(changed)}): resume with "
                "the checkpoint's model settings (its config.yaml), or pass --no-resume with another checkpoint.dir")

    def load(self, engine, tag: str, layout: dict, load_optimizer: bool = True) -> dict:
        """Load model + optimizer into `engine`; returns the trainer state. At the saving layout and ZeRO stage
        DeepSpeed reads its own files and each rank its RNG states; at another layout or stage (or without the
        optimizer) megahybrid.convert.reshard maps the full tensors onto this one (README "Another layout")."""
        from megahybrid.convert.zero import saved_zero_stage  # convert imports this module

        path = os.path.join(self.root, tag)
        with open(os.path.join(path, TRAINER_STATE)) as f:
            state = json.load(f)
        saved, ours = (state.get("layout"), saved_zero_stage(path)), (layout, engine.zero_optimization_stage())
        if saved != ours or not load_optimizer:
            self._load_resharded(engine, path, load_optimizer, saved, ours)
            return state
        load_path, _ = engine.load_checkpoint(self.root, tag=tag, load_optimizer_states=True,
                                              load_lr_scheduler_states=False)
        if load_path is None:
            raise UserError(f"checkpoint {path} could not be loaded by DeepSpeed: remove it or pass --no-resume")
        set_rng_state(safe_load(os.path.join(path, "rng", f"rank_{self.rank:05d}.pt")))
        return state

    def _load_resharded(self, engine, path: str, load_optimizer: bool, saved: tuple, ours: tuple) -> None:
        from megahybrid.convert.reshard import load_resharded

        step = load_resharded(engine, path, load_optimizer)
        where = lambda lay, stage: " ".join(f"{k}={lay.get(k)}" for k in ("tp", "cp", "dp")) + f" ZeRO-{stage}"
        what = (f"weights, fp32 master weights and Adam moments resharded (Adam step {step})" if load_optimizer else
                "weights resharded; optimizer state NOT loaded (checkpoint.load_optimizer=false): Adam moments "
                "restart at zero")
        if self.rank == 0:
            self.warn(f"resuming {path} saved at {where(saved[0] or {}, saved[1])} at {where(*ours)}: {what}; "
                      "per-rank RNG states restart from train.seed")
