"""The training loop: validated plan -> process groups -> model + DeepSpeed engine -> data -> steps with
logging, evaluation, checkpoints, signal handling and non-finite-loss skipping.

Exit codes (also in megahybrid/train/README.md): 0 finished; 1 crashed; 2 user error (config, data, launch,
checkpoint, output directories); 3 stopped by SIGTERM/SIGUSR1/Ctrl-C after saving a checkpoint, or during start-up
with nothing to save (requeue and it resumes); 4 stopped after `train.max_consecutive_nonfinite` non-finite losses
or gradient norms in a row (checkpoint saved); 130 a second Ctrl-C aborted without saving.
"""
import json
import logging
import math
import os
import shlex
import signal
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megahybrid.convert.init import load_full_weights
from megahybrid.distributed import init_distributed, shutdown
from megahybrid.errors import EXIT_USER_ERROR, UserError
from megahybrid.model.config import count_parameters
from megahybrid.model.cp import shard_batch
from megahybrid.model.mixers import (
    cp_bytes_per_layer,
    cp_flops_per_layer,
    eager_mixers,
    state_floats,
)
from megahybrid.outputs import check_writable
from megahybrid.train import compile_cache, rundir
from megahybrid.train.checkpoint import TRAINER_STATE, CheckpointManager, all_gather
from megahybrid.train.config import RunConfig, resolved_compile, validate, zero_stage
from megahybrid.train.data import build_splits, prepare_data, train_loader, valid_loader
from megahybrid.train.engine import LRSchedule, build_engine, set_lr
from megahybrid.train.metrics import TrainLogger, flops_per_token, memory_mib, model_metrics, say
from megahybrid.train.signals import EXIT_ABORTED, EXIT_REQUEUE, install_stop_handlers

EXIT_OK, EXIT_CRASH, EXIT_NONFINITE = 0, 1, 4


@dataclass
class QueuedStep:
    """A step whose work is queued: its number, learning rate, the samples consumed through it and [loss sum,
    non-finite count, stop flag, gradient norm], a device tensor until Trainer.conclude reads it (host floats where
    the step had to read them itself)."""

    step: int
    lr: float
    consumed_samples: int
    values: torch.Tensor | list


@dataclass
class Plan:
    """Everything decided before a process group exists."""

    cfg: RunConfig
    model: object
    layout: object
    ds_base: dict
    precision: str
    data: object
    world_size: int


def make_plan(cfg: RunConfig, world_size: int) -> Plan:
    """Validate the whole config and prepare data; raises UserError with one line on the first problem."""
    model, layout, ds_base, precision = validate(cfg, world_size, torch.cuda.is_available(), check_data=False)
    data = prepare_data(cfg, model.seq_length, model.vocab_size)
    return Plan(cfg, model, layout, ds_base, precision, data, world_size)


def set_deterministic(enabled: bool) -> None:
    """Bitwise-reproducible kernels. CUBLAS_WORKSPACE_CONFIG is read when cuBLAS creates its first handle, so this
    runs before the process group and the model exist."""
    if not enabled:
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


def compile_model(engine, model_cfg, scope: str = "model") -> None:
    """torch.compile, the layers of the mixers measured slower compiled on a GPU kept eager (on CPU too, so CPU tests
    run what a GPU runs): a graph break at each of their mixer modules; inductor fuses the norms, MLPs and residuals
    around them. By layer, not by module class: I and D share one.

    scope `model` compiles the whole model through the DeepSpeed engine; `layers` compiles each decoder layer, the
    final norm and the output layer with the loss on their own. Layers of one kind then share one compiled graph,
    so compile time does not grow with depth: on CPU (tiny model, cold caches, two steps; eager 7 s) 24 layers took
    105.5 s whole against 34.3 s by layer, 4 layers 48.2 s against 34.3 s. What it gives up is fusion across layer
    boundaries."""
    eager = eager_mixers(model_cfg.pattern)
    for layer, char in zip(engine.module.decoder.layers, model_cfg.layer_pattern):
        if char in eager:
            layer.self_attention.forward = torch.compiler.disable(layer.self_attention.forward)
    if scope == "model":
        engine.compile()
    else:
        compile_by_layer(engine.module)


def compile_by_layer(model) -> None:
    """train.compile_scope=layers on a GPTModel: each decoder layer, the final norm and the output layer with the
    loss (megatron's `_postprocess`) compiled on their own, in place."""
    regions = list(model.decoder.layers)
    final_norm = getattr(model.decoder, "final_layernorm", None)
    if final_norm is not None:
        regions.append(final_norm)
    for region in regions:
        region.compile()
    model._postprocess = torch.compile(model._postprocess)


class Trainer:
    def __init__(self, plan: Plan, resume: bool = True):
        from megahybrid.model.gpt import build_model  # megatron: imported with the first Trainer, not the module

        self.plan, self.cfg = plan, plan.cfg
        # before anything builds a kernel: our Triton kernels compile at their first launch, inductor at the first step
        self.compile_cache = compile_cache.use(self.cfg.train.compile_cache, self.cfg.run_dir)
        set_deterministic(self.cfg.train.deterministic)
        self.groups = init_distributed(plan.layout, seed=self.cfg.train.seed)
        self.is_logger = self.groups.is_loss_rank
        self._claim_outputs()
        _quiet_deepspeed()
        self.model = build_model(plan.model, plan.layout, plan.precision)
        self.init_source = self._init_weights(resume)
        self.engine, self.optimizer, self.ds_config = build_engine(
            self.model, self.cfg, self.groups, plan.ds_base, plan.precision)
        self.compiled = resolved_compile(self.cfg, torch.cuda.is_available(), plan.ds_base)
        if self.compiled:
            compile_model(self.engine, plan.model, self.cfg.train.compile_scope)
        self.gas = self.engine.gradient_accumulation_steps()
        self.flops_per_token = flops_per_token(plan.model)
        self.num_params = count_parameters(plan.model)
        self.step, self.skipped, self.consecutive_nonfinite, self.consumed_samples = 0, 0, 0, 0
        self._interval = (0.0, 0)  # seconds and steps since the last console line
        self._first_compiled, self._last_read = False, 0.0  # run: the first step pays the compile; last read time
        self.ckpt = CheckpointManager(self.cfg.checkpoint_dir, self.cfg.checkpoint.keep, warn=self._warn,
                                      hooks=self._checkpoint_hook)
        self.resume_tag = self._resume() if resume else self._refuse_existing()
        self.schedule = self._run_schedule()
        train_ds, self.valid_ds = build_splits(self.cfg, plan.data, plan.model.seq_length)
        if self.valid_ds is None and self.cfg.eval.iters > 0:
            self._warn(f"warning: eval.iters={self.cfg.eval.iters} but the validation split is empty (data.split="
                       f"{plan.data.split}): no validation; give it a share in data.split or set eval.iters=0")
        self.loader = train_loader(self.cfg, train_ds, self.groups, self.consumed_samples, plan.data.num_workers)
        self.logger = TrainLogger(self.is_logger, self.cfg.run_dir,
                                  self.cfg.tensorboard_dir if self.cfg.logging.tensorboard else None,
                                  self.cfg.train.steps)
        self.stop = install_stop_handlers()
        self.stop.defer()

    def _claim_outputs(self) -> None:
        """Every output directory writable (all ranks) and locked (rank 0) before any work; same error on all ranks."""
        problem = None
        try:
            for field, path in rundir.output_dirs(self.cfg).items():
                check_writable(field, path)
            if self.groups.rank == 0:
                rundir.lock_outputs(self.cfg)
        except UserError as err:
            problem = str(err)
        problems = [p for p in all_gather(problem) if p]
        if problems:
            raise UserError(problems[0])

    def _init_weights(self, resume: bool) -> str | None:
        """checkpoint.init_from, before the engine copies the weights into ZeRO; a run with checkpoints resumes them."""
        path = self.cfg.checkpoint.init_from
        if not path or (resume and CheckpointManager(self.cfg.checkpoint_dir, 1).tags()):
            return None
        load_full_weights(self.model, path, self.plan.model, self.groups.tp_rank, self.groups.layout.tp)
        return path

    def _warn(self, message: str) -> None:
        if self.is_logger:
            print(message, file=sys.stderr, flush=True)

    def _checkpoint_hook(self, stage: str, step: int) -> None:
        if stage == "written" and step == self.cfg.debug.sigkill_in_save_at_step:
            os.kill(os.getpid(), signal.SIGKILL)

    def _resume(self) -> str | None:
        self.ckpt.clean_stale()
        tag = self.ckpt.find_loadable()
        if tag is None:
            if self.ckpt.tags():
                raise UserError(
                    f"checkpoint.dir {self.cfg.checkpoint_dir} holds checkpoints {self.ckpt.tags()} and none can be "
                    "loaded (warnings above); nothing was changed: repair or restore them, or pass --no-resume with "
                    "another checkpoint.dir (or run_dir)")
            return None
        self.ckpt.check_model(tag, self.plan.model)
        state = self.ckpt.load(self.engine, tag, self.layout_dict(), self.cfg.checkpoint.load_optimizer)
        self.step = state["step"]
        self.consumed_samples = state["consumed_samples"]
        self.skipped = state["skipped_steps"]
        self.consecutive_nonfinite = state["consecutive_nonfinite"]
        return tag

    def _run_schedule(self) -> LRSchedule:
        """The config's LR schedule; on resume the one saved with the run unless optimizer.reschedule, so that a
        larger train.steps does not silently raise the learning rate again."""
        o = self.cfg.optimizer
        configured = LRSchedule(o.lr, o.min_lr, o.warmup_steps, self.cfg.train.steps, o.schedule)
        saved = self._saved_schedule()
        if saved is None or o.reschedule or saved.state_dict() == configured.state_dict():
            return configured
        self._warn(f"keeping the LR schedule saved with the run ({saved.describe()}); this config asks for "
                   f"{configured.describe()}: set optimizer.reschedule=true to switch to it")
        return saved

    def _saved_schedule(self) -> LRSchedule | None:
        if self.resume_tag is None:
            return None
        with open(os.path.join(self.cfg.checkpoint_dir, self.resume_tag, TRAINER_STATE)) as f:
            state = json.load(f).get("lr_schedule")
        return LRSchedule.from_state(state) if state else None

    def _refuse_existing(self) -> None:
        if self.ckpt.tags():
            raise UserError(
                f"--no-resume but checkpoint.dir {self.cfg.checkpoint_dir} already holds checkpoints: set another "
                "checkpoint.dir (or run_dir) or delete it"
            )

    def layout_dict(self) -> dict:
        lay = self.groups.layout
        return {"tp": lay.tp, "cp": lay.cp, "dp": lay.dp, "pp": lay.pp, "sequence_parallel": lay.sequence_parallel}

    def trainer_state(self) -> dict:
        return {
            "step": self.step, "consumed_samples": self.loader.consumed_samples,
            "consumed_tokens": self.loader.consumed_samples * self.plan.model.seq_length,
            "skipped_steps": self.skipped, "consecutive_nonfinite": self.consecutive_nonfinite,
            "data_loader": self.loader.state_dict(), "lr_schedule": self.schedule.state_dict(),
            "world_size": self.plan.world_size, "layout": self.layout_dict(), "time": time.time(),
        }

    def save(self) -> str:
        return self.ckpt.save(self.engine, self.step, self.trainer_state(), self.cfg.to_yaml())

    def train_step(self, batches) -> dict:
        """One step, read at once (tests and tools); `run` reads each step after queueing the next."""
        return self.conclude(self.queue_step(batches))

    def queue_step(self, batches) -> QueuedStep:
        """One optimizer step over `gas` micro-batches, queued on the device; a non-finite loss on any rank skips
        the update. Under ZeRO-1/2 with optimizer.clip_on_device it reads nothing on the host."""
        lr = self.schedule(self.step)
        set_lr(self.optimizer, lr)
        poisoned = (self.step + 1) in self.cfg.debug.nan_loss_steps
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.engine.device)
        for micro in range(self.gas):
            batch = {k: v.to(self.engine.device, non_blocking=True) for k, v in next(batches).items()}
            loss = self._loss(batch)
            if poisoned:
                loss = loss * float("nan")
            self.engine.backward(loss)
            loss_sum += loss.detach().double()
            if micro < self.gas - 1:
                self.engine.step()
        # new_full is a fill on the device; torch.tensor(..., device=) would be a blocking host-to-device copy.
        stop = loss_sum.new_full((), float(self.stop.requested))
        flags = torch.stack([loss_sum, (~torch.isfinite(loss_sum)).double(), stop])
        dist.all_reduce(flags)
        if self.optimizer.device_clip is not None:
            values = self._device_skipped_step(flags)
        else:
            values = self._host_skipped_step(flags)
        self.step += 1
        return QueuedStep(self.step, lr, self.loader.consumed_samples, values)

    def conclude(self, queued: QueuedStep) -> dict:
        """The step's one host read (it waits for the step's work), and the skip counts it updates."""
        values = queued.values.tolist() if isinstance(queued.values, torch.Tensor) else queued.values
        loss_total, nonfinite, stop, norm = values
        # A non-finite global norm cancels the update (our found_inf or ZeRO's own check); counted as a skip.
        skip = nonfinite > 0 or not math.isfinite(norm)
        self.skipped += int(skip)
        self.consecutive_nonfinite = self.consecutive_nonfinite + 1 if skip else 0
        return {"step": queued.step, "loss": loss_total / (self.gas * dist.get_world_size()), "lr": queued.lr,
                "skip": skip, "stop": stop > 0, "grad_norm": norm, "consumed_samples": queued.consumed_samples}

    def _device_skipped_step(self, flags: torch.Tensor) -> torch.Tensor:
        """The optimizer step with the skip decision on the device; the step's values stay there."""
        self.optimizer.skip_flag = flags[1] > 0
        try:
            self.engine.step()
        finally:
            self.optimizer.skip_flag = None
        norm = torch.as_tensor(self.engine.get_global_grad_norm(), dtype=torch.float64, device=flags.device)
        return torch.cat([flags, norm.reshape(1)])

    def _host_skipped_step(self, flags: torch.Tensor) -> list[float]:
        """ZeRO-3 and offload: the skip decision read on the host before the step (DeepSpeed's clipping reads the
        norm there too)."""
        loss_total, nonfinite, stop = flags.tolist()
        self.optimizer.skipping = nonfinite > 0
        try:
            self.engine.step()
        finally:
            self.optimizer.skipping = False
        norm = self.engine.get_global_grad_norm()
        return [loss_total, nonfinite, stop, float(norm) if norm is not None else float("nan")]

    def _loss(self, batch: dict) -> torch.Tensor:
        from megahybrid.model.gpt import lm_loss  # megatron: see __init__

        batch = shard_batch(batch, self.groups.cp_rank, self.groups.layout.cp)
        cp_group = self.groups.cp_group if self.groups.layout.cp > 1 else None
        return lm_loss(self.engine, batch["tokens"], batch["labels"], batch["loss_mask"], cp_group)

    @torch.no_grad()
    def evaluate(self) -> dict | None:
        if self.valid_ds is None or self.cfg.eval.iters == 0:
            return None
        self.engine.eval()
        total, count = torch.zeros((), dtype=torch.float64), 0
        for batch in valid_loader(self.cfg, self.valid_ds, self.groups):
            batch = {k: v.to(self.engine.device) for k, v in batch.items()}
            total += self._loss(batch).double().cpu()
            count += 1
        self.engine.train()
        total = total.to(self.engine.device)
        dist.all_reduce(total)
        loss = total.item() / max(1, count * dist.get_world_size())
        return {"valid/loss": loss, "valid/perplexity": math.exp(min(loss, 700.0))}

    def _log(self, result: dict, step_time: float) -> None:
        tokens = self.cfg.batch.global_batch_size * self.plan.model.seq_length
        tflops = self.flops_per_token * tokens / step_time / self.plan.world_size / 1e12
        values = {
            "train/loss": result["loss"], "train/lr": result["lr"], "train/grad_norm": result["grad_norm"],
            "train/skipped_steps": float(self.skipped),
            "train/consumed_tokens": float(result["consumed_samples"] * self.plan.model.seq_length),
            "perf/tokens_per_s": tokens / step_time, "perf/tflops_per_gpu": tflops,
            "perf/mfu": tflops / self.cfg.logging.peak_tflops, "time/step_s": step_time, **memory_mib(),
        }
        step = result["step"]
        self.logger.scalars(step, values)
        self._interval = (self._interval[0] + step_time, self._interval[1] + 1)
        if step % self.cfg.logging.interval == 0 or step == self.cfg.train.steps:
            self.logger.scalars(step, model_metrics(self.model))
            mean_time = self._interval[0] / self._interval[1]
            self._interval = (0.0, 0)
            scale = step_time / mean_time
            self.logger.progress(step, {**values, "perf/tokens_per_s": values["perf/tokens_per_s"] * scale,
                                        "perf/tflops_per_gpu": tflops * scale, "perf/mfu": values["perf/mfu"] * scale})

    def _compile_text(self) -> str:
        eager = eager_mixers(self.plan.model.pattern) if self.compiled else ""
        if self.cfg.train.compile == "auto" and not self.compiled and torch.cuda.is_available():
            return "False(auto: not under ZeRO-3 on a GPU)"
        if not self.compiled:
            return "False"
        scope = self.cfg.train.compile_scope
        notes = [f"by {scope}"] if scope != "model" else []
        notes += [f"cache {self.compile_cache}"]
        notes += [f"eager mixers: {eager}"] if eager else []
        return f"True({'; '.join(notes)})"

    def print_start(self) -> None:
        if not self.is_logger:
            return
        lay = self.groups.layout
        derived = (
            f"# derived: world_size={self.plan.world_size} tp={lay.tp} cp={lay.cp} dp={lay.dp} "
            f"grad_accumulation={self.gas} precision={self.plan.precision} zero_stage={zero_stage(self.ds_config)} "
            f"params={self.num_params / 1e6:.2f}M flops_per_token={self.flops_per_token:.3e} "
            f"compile={self._compile_text()} device={self.engine.device} "
            f"{_state_line(self.plan.model, lay.cp, self.plan.precision)}"
        )
        text = self.cfg.to_yaml() + derived
        print("resolved config:\n" + text, flush=True)
        note = self.plan.model.interdomain.extrapolation_note(self.plan.model.pattern, self.plan.model.seq_length)
        if note:
            print(note, flush=True)
        self.logger.text("config", text)
        os.makedirs(self.cfg.run_dir, exist_ok=True)
        with open(os.path.join(self.cfg.run_dir, "config.yaml"), "w") as f:
            f.write(self.cfg.to_yaml())
        if self.init_source:
            print(f"initialized the weights from {self.init_source} (fresh optimizer, step 0)", flush=True)
        if self.resume_tag:
            print(f"resumed from {os.path.join(self.cfg.checkpoint_dir, self.resume_tag)} at step {self.step}",
                  flush=True)

    def run(self) -> int:
        self.print_start()
        batches = iter(self.loader)
        self.logger.start(self.step)
        code, last_saved = EXIT_OK, self.step if self.resume_tag else None
        self._first_compiled, pending = self.compiled, None
        self._last_read = time.monotonic()
        while self.step < self.cfg.train.steps:
            queued = self.queue_step(batches)
            if self.cfg.debug.sleep_per_step:
                time.sleep(self.cfg.debug.sleep_per_step)
            if pending is not None:
                code = self._conclude_and_log(pending)
            pending = queued
            if code == EXIT_OK and not self._read_at_once(self.step):
                continue  # read once the next step is queued: the device never waits for the host between steps
            latest = self._conclude_and_log(pending)
            code, pending = code or latest, None
            if self.step % self.cfg.eval.interval == 0:
                self._evaluate_and_log()
            if code != EXIT_OK:
                break
            if self.step % self.cfg.checkpoint.interval == 0:
                self.save()
                last_saved = self.step
            if self.step == self.cfg.debug.sigkill_after_step:
                os.kill(os.getpid(), signal.SIGKILL)
            self._last_read = time.monotonic()  # the host work above is no step's time
        if code == EXIT_OK and self.step % self.cfg.eval.interval:
            self._evaluate_and_log()
        saved = os.path.join(self.cfg.checkpoint_dir, f"step_{self.step:08d}")
        path = self.save() if last_saved != self.step else saved
        self.logger.close()
        self._report_end(code, path)
        return code

    def _read_at_once(self, step: int) -> bool:
        """Whether this step is read before the next one is queued: host work that must see its weights or
        telemetry follows it (evaluation, checkpoint, console line, the last step, the debug kill), or its being
        non-finite would end training (after a skipped step, or when one non-finite step is the limit), which must
        stop the run at this step with no later update queued."""
        c, skips = self.cfg, self.consecutive_nonfinite
        nonfinite_decides = skips > 0 or skips + 1 >= c.train.max_consecutive_nonfinite
        return (nonfinite_decides or step >= c.train.steps or step % c.eval.interval == 0
                or step % c.checkpoint.interval == 0 or step % c.logging.interval == 0
                or step == c.debug.sigkill_after_step)

    def _conclude_and_log(self, queued: QueuedStep) -> int:
        """Read a queued step, log it (its time: since the previous read), and say whether training stops there."""
        result = self.conclude(queued)
        now = time.monotonic()
        step_time, self._last_read = now - self._last_read, now
        self._log(result, step_time)
        if self._first_compiled:
            self._report_compile(step_time)
            self._first_compiled = False
        if result["stop"]:
            return EXIT_REQUEUE
        return EXIT_NONFINITE if self.consecutive_nonfinite >= self.cfg.train.max_consecutive_nonfinite else EXIT_OK

    def _report_compile(self, seconds: float) -> None:
        """After the first compiled step: its time and how much of the compilation the cache served."""
        cached = compile_cache.summary()
        say(self.is_logger, f"first step {seconds:.1f} s with torch.compile" + (f" ({cached})" if cached else ""))

    def _evaluate_and_log(self) -> None:
        values = self.evaluate()
        if values:
            self.logger.scalars(self.step, values)
            say(self.is_logger, f"validation at step {self.step}: loss {values['valid/loss']:.4f}  "
                                f"perplexity {values['valid/perplexity']:.2f}")

    def _report_end(self, code: int, path: str) -> None:
        if not self.is_logger:
            return
        if code == EXIT_REQUEUE:
            print(f"received {self.stop.signal_name or 'a stop signal on another rank'}: saved {path}; exiting with "
                  f"code {EXIT_REQUEUE} so the launcher can requeue (the next start resumes there)", flush=True)
        elif code == EXIT_NONFINITE:
            print(f"error: {self.consecutive_nonfinite} steps in a row had a non-finite loss or gradient norm "
                  f"(last: step {self.step}); "
                  f"saved {path}; lower optimizer.lr, raise optimizer.warmup_steps or check the data, then resume",
                  file=sys.stderr, flush=True)
        else:
            print(f"training finished at step {self.step}: checkpoint {path}", flush=True)
        self._print_telemetry()
        python, world = shlex.quote(sys.executable), self.plan.world_size
        ranks = "" if world == 1 else f"--nproc-per-node {world} "
        where = "" if world == 1 else "; on one node, else with your torchrun / srun / mpirun line"
        config = shlex.quote(os.path.join(self.cfg.run_dir, "config.yaml"))
        print(f"resume: {python} -m megahybrid train {ranks}--config {config} [train.steps=N to go further] "
              f"(continues from {self.cfg.checkpoint_dir}/latest{where})", flush=True)
        if self.cfg.logging.tensorboard:
            print(f"tensorboard: {python} -m tensorboard.main --logdir {shlex.quote(self.cfg.tensorboard_dir)}",
                  flush=True)


    def _print_telemetry(self) -> None:
        """The mixers' own scalars (tensorboard_scalars) of the last step, one line per layer, at the end."""
        per_layer: dict[str, list[str]] = {}
        for key, value in model_metrics(self.model).items():
            layer, _, name = key.rpartition("/")
            per_layer.setdefault(layer, []).append(f"{name} {value:.4g}")
        if per_layer:
            print("mixer telemetry (last step):", flush=True)
        for layer, values in per_layer.items():
            print(f"  {self._layer_name(layer)}  " + "  ".join(values), flush=True)

    def _layer_name(self, path: str) -> str:
        """decoder.layers.3.self_attention -> "layer 3 (N)" (the module path where it is not a layer's)."""
        parts = path.split(".")
        if "layers" not in parts or not parts[parts.index("layers") + 1].isdigit():
            return path
        index = int(parts[parts.index("layers") + 1])
        return f"layer {index} ({self.plan.model.layer_pattern[index]})"


def _state_line(model_cfg, cp: int, precision: str) -> str:
    """Decode-state floats per sequence and layer of each mixer kind at the training context, and under context
    parallelism the bytes each CP rank sends per layer and sequence in a training step and the forward FLOPs per
    token the state passing adds on the last CP rank."""
    per_mixer = ",".join(f"{c}:{n}" for c, n in state_floats(model_cfg, model_cfg.seq_length).items())
    line = f"state_floats_per_layer@{model_cfg.seq_length}={per_mixer}"
    if cp > 1:
        sent = cp_bytes_per_layer(model_cfg, cp, 2 if precision == "bf16" else 4)
        line += " cp_bytes_sent_per_layer_per_sequence=" + ",".join(f"{c}:{n}" for c, n in sent.items())
        extra = cp_flops_per_layer(model_cfg, cp)
        line += " cp_extra_flops_per_token_per_layer=" + ",".join(f"{c}:{n:.0f}" for c, n in extra.items())
    return line


def _quiet_deepspeed() -> None:
    from deepspeed.utils import logger  # DeepSpeed takes seconds to import: only when training starts

    logger.setLevel(logging.WARNING)


def train(cfg: RunConfig, resume: bool = True) -> int:
    """Validate, then train; returns the exit code. Call after `resolve_launch_env()`."""
    plan = make_plan(cfg, int(os.environ.get("WORLD_SIZE", "1")))
    try:
        return Trainer(plan, resume=resume).run()
    finally:
        rundir.release_all()
        shutdown()


__all__ = ["train", "make_plan", "Trainer", "EXIT_OK", "EXIT_CRASH", "EXIT_USER_ERROR", "EXIT_REQUEUE",
           "EXIT_NONFINITE", "EXIT_ABORTED", "UserError"]
