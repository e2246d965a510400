"""The training loop: accelerate (DeepSpeed ZeRO 0-3 or DDP, or one process), EAGLE-3 TTT or EAGLE-1 loss.

    accelerate launch [--config_file configs/accelerate/<x>.yaml] -m train RECIPE [key=value ...]
    python -m train RECIPE                       # one process

One optimizer step = grad_accum micro-batches per rank. Every rank reads its own micro-batches of a
deterministic epoch order (train.batches) through a DataLoader (train.loader), so a resumed run continues exactly
where the checkpoint was taken, also with another number of processes. Re-running the same command resumes from
the latest complete checkpoint in train.output_dir. Host syncs (loss, accuracy, grad norm) happen every
train.log_every steps only.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import time
from dataclasses import asdict
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import InitProcessGroupKwargs, set_seed

from drafthead import DraftHead, HeadConfig
from drafthead.checkpoint import load_head
from drafthead.config import default_aux_layer_ids
from drafthead.errors import DataError
from drafthead.utils import atomic_write_json, dtype_name, mixed_precision, rotary_frequencies
from drafthead.vocab import build_draft_vocab, full_vocab, token_frequencies
from train.batches import PreparedSequences, collate, epoch_batches, rank_batches, with_online_features
from train.evaluate import evaluate
from train.features import FeatureDataset
from train.fingerprint import differences, split_fingerprint, weights_fingerprint
from train.loader import PlanSampler, Position, StepPlan, make_loader
from train.loss import DraftTrainModule
from train.rank_sync import checksum, share_draft_vocab
from train.recipe import Recipe, TrainSection, parse_recipe
from train.state import TRAINER_STATE, clean_partial, gathered_params, latest_checkpoint, load_checkpoint, \
    save_checkpoint, save_head_folder
from train.target import load_borrowed, load_target, target_config_hash, target_name


def lr_at(config: TrainSection, step: int, total: int) -> float:
    """Linear warmup then cosine decay to min_lr_ratio·lr; a pure function of the step (resume-exact)."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    progress = (step - config.warmup_steps) / max(1, total - config.warmup_steps)
    floor = config.min_lr_ratio
    return config.lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def skip_shm_comm_build() -> None:
    """Tell DeepSpeed its CPU shared-memory collectives are unavailable: building them is a ~70 s JIT compile on
    first init, and gloo serves. DeepSpeed (0.19) has no public switch for this (DS_BUILD_* only act at install
    time), so the probe result it caches in deepspeed.ops.__compatible_ops__ is overridden."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def make_accelerator(config: TrainSection) -> Accelerator:
    """An Accelerator with gloo on CPU (DeepSpeed and DDP), the launcher's engine, and a sanity check."""
    skip_shm_comm_build()
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    distributed = launched > 1 or os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true"
    handlers = [InitProcessGroupKwargs(backend="gloo")] if distributed and not torch.cuda.is_available() else []
    accelerator = Accelerator(mixed_precision=mixed_precision(config.mixed_precision),
                              gradient_accumulation_steps=config.grad_accum, kwargs_handlers=handlers)
    if launched != accelerator.num_processes:
        raise RuntimeError(
            f"{launched} processes were launched but accelerate runs {accelerator.num_processes} without gradient "
            "sync (on CPU use `accelerate launch --use_deepspeed --zero_stage N --num_processes 2 --num_machines 1` "
            "or ACCELERATE_USE_CPU=true with --multi_gpu for DDP)"
        )
    return accelerator


def _open_split(recipe: Recipe, split: str):
    """The dataset of a split: features (offline) or prepared sequences (online); None if it does not exist."""
    if recipe.train.online:
        try:
            return PreparedSequences(Path(recipe.data.prepared_dir), split)
        except KeyError:
            if split == "train":
                raise
            return None
    folder = Path(recipe.features.split_dir(split))
    if split != "train" and not (folder / "manifest.json").exists():
        return None
    return FeatureDataset(folder)


def _check_features(recipe: Recipe, kind: str, aux: list[int], features: FeatureDataset) -> None:
    """Features must hold the head's aux layers and come from this target."""
    manifest = features.manifest
    if kind == "eagle3" and list(manifest.get("aux_layer_ids", aux)) != list(aux):
        raise DataError(
            f"features in {features.folder} hold aux layers {manifest['aux_layer_ids']}, the recipe's head wants "
            f"{list(aux)}: set head.aux_layer_ids to match or re-collect the features"
        )
    expected = target_config_hash(recipe.target)
    if manifest.get("target_config_hash", expected) != expected:
        raise DataError(f"features in {features.folder} were collected from another target "
                        f"(config hash {manifest['target_config_hash']} != {expected}): collect them again")
    weights = weights_fingerprint(recipe.target)
    if manifest.get("target_weights", weights) != weights:
        raise DataError(f"features in {features.folder} were collected from other weights of this target "
                        f"(weights fingerprint {manifest['target_weights']} != {weights}): collect them again")


def build_head(recipe: Recipe, target, train_set, count_tokens: bool = True) -> DraftHead:
    """Head shaped after the target, aux ids checked against the features, draft vocab from the train tokens
    (count_tokens=False: left empty, for a rank that receives rank 0's); or, with head.init_from, the weights, aux
    layers and draft vocabulary of an existing head (fine-tuning)."""
    kind = recipe.head.kind
    if recipe.head.init_from:
        return _head_from(recipe, target, train_set)
    text = target.config.get_text_config()
    aux = recipe.head.aux_layer_ids or default_aux_layer_ids(text.num_hidden_layers)
    if isinstance(train_set, FeatureDataset):
        _check_features(recipe, kind, aux, train_set)
    vocab_size = text.vocab_size
    draft_vocab = min(recipe.head.draft_vocab_size or vocab_size, vocab_size)
    config = HeadConfig.from_target_config(target.config, kind=kind, draft_vocab_size=draft_vocab,
                                           aux_layer_ids=aux, target_name=target_name(recipe.target))
    head = DraftHead(config).attach_target(target)
    if head.eagle3 and count_tokens:
        if draft_vocab < vocab_size:
            d2t, t2d = build_draft_vocab(token_frequencies(train_set.token_arrays(), vocab_size), draft_vocab)
        else:
            d2t, t2d = full_vocab(vocab_size)
        head.d2t.copy_(d2t)
        head.t2d.copy_(t2d)
    return head


def _head_from(recipe: Recipe, target, train_set) -> DraftHead:
    """head.init_from: a native or exported head folder made for this target and of the recipe's head kind. Its
    aux layers and draft vocabulary are kept (the features must hold those layers); the weights load in fp32."""
    path = Path(recipe.head.init_from).expanduser()
    head = load_head(path, target=target, kind=recipe.head.kind, device="cpu", dtype=torch.float32)
    aux = list(head.config.aux_layer_ids)
    if recipe.head.aux_layer_ids is not None and list(recipe.head.aux_layer_ids) != aux:
        raise ValueError(f"head.init_from={path} reads aux layers {aux}, the recipe sets head.aux_layer_ids="
                         f"{list(recipe.head.aux_layer_ids)}: drop head.aux_layer_ids or make them agree")
    if isinstance(train_set, FeatureDataset):
        _check_features(recipe, head.config.kind, aux, train_set)
    print(f"[train] head initialised from {path} ({head.config.kind}, aux layers {aux}, "
          f"draft vocab {head.config.draft_vocab_size})")
    return head


class Trainer:
    """Builds everything from a recipe; `run()` trains to max_steps, resuming when a checkpoint exists.

    With train.debug_report the run also records what tests and benchmarks check (which sequences each rank
    trained on, full parameter sums before and after, peak memory, the time of every step and of its features,
    forward, backward and optimizer parts) into output_dir/ranks/rank-<r>.json; without it none of that is kept,
    computed or synchronised.
    """

    def __init__(self, recipe: Recipe | dict):
        self.recipe = recipe = parse_recipe(recipe)
        self.config = config = recipe.train
        # Load the frozen target before the Accelerator exists: under a ZeRO-3 launch transformers would
        # otherwise partition it (zero.Init), and the head copies its embedding / norm / lm_head.
        # Offline, only the modules the head borrows are loaded (embedding, final norm, lm_head; layers on meta).
        target = load_target(recipe.target, device="cpu", dtype=recipe.dtype) if config.online else \
            load_borrowed(recipe.target)
        self.accelerator = acc = make_accelerator(config)
        self.output_dir = Path(config.output_dir)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        set_seed(config.seed)  # identical head init on every rank
        device = acc.device
        self.train_set = _open_split(recipe, "train")
        self.val_set = self._usable_validation(_open_split(recipe, "validation"), acc.num_processes)
        if config.online:
            target = target.to(device)
        # the draft vocabulary is counted once, on rank 0, and broadcast below
        head = build_head(recipe, target, self.train_set, count_tokens=acc.is_main_process)
        self.target = target if config.online else None  # offline: only the borrowed modules are kept
        self.target_dtype = dtype_name(target.dtype)  # online: the target's forward; offline: the borrowed modules
        self.aux_layer_ids = head.config.aux_layer_ids
        module = DraftTrainModule(head, target, config.ttt_steps, config.ttt_decay, config.feature_noise,
                                  compile_loss=config.compile_loss).to(device)
        if not config.online:
            del target
        share_draft_vocab(acc, module.head)  # rank 0's draft vocabulary on every rank, checked
        params = [p for p in module.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay, betas=(0.9, 0.95))
        plugin = acc.state.deepspeed_plugin
        if plugin is not None:  # fill what accelerate cannot infer (we feed our own per-rank batches)
            plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = config.batch_size or 1
            plugin.deepspeed_config["gradient_clipping"] = config.max_grad_norm
        self.model, self.optimizer = acc.prepare(module, optimizer)
        self.head = acc.unwrap_model(self.model).head
        self.engine = type(self.model).__name__
        self._check_engine()
        self.plan = StepPlan(self.train_set.lengths(), config.seed, config.batch_size, config.batch_tokens,
                             config.max_length, config.grad_accum, acc.process_index, acc.num_processes)
        self.lengths = self.plan.lengths
        self.val_lengths = self.val_set.lengths() if self.val_set is not None else []
        self.total_steps = self.count_steps(Position(), 0)  # run() counts again from the resumed position
        self.inputs = self.run_inputs()
        self.debug: DebugReport | None = None  # made by run() once the checkpoint (if any) is loaded

    # ------------------------------------------------------------------------------------------ setup
    def _usable_validation(self, val_set, processes: int):
        """The validation split, or None (training without evaluation, said once) when it makes fewer
        micro-batches than there are processes to evaluate them."""
        if val_set is None:
            return None
        c = self.config
        batches = len(epoch_batches(val_set.lengths(), 0, 0, c.batch_size, c.batch_tokens, c.max_length))
        if batches >= processes:
            return val_set
        self.accelerator.print(
            f"[train] warning: the validation split ({len(val_set)} sequences) makes {batches} micro-batch(es) "
            f"for {processes} process(es): "
            f"training without evaluation (raise data.validation_fraction, now "
            f"{self.recipe.data.validation_fraction}, and prepare again to evaluate)")
        return None

    def run_inputs(self) -> dict:
        """What a checkpoint's data position and weights mean: the training data's fingerprint and the recipe
        keys that fix the data order and the head's shape. A resume with other values is refused."""
        r, c = self.recipe, self.config
        if c.online:
            data = split_fingerprint(self.train_set.data)
        else:
            manifest = self.train_set.manifest
            data = "/".join(str(manifest.get(k)) for k in ("data_fingerprint", "target_weights", "num_sequences",
                                                          "num_tokens"))
        return {"train data": data, "head.kind": r.head.kind, "head.aux_layer_ids": list(self.aux_layer_ids),
                "head.draft_vocab_size": r.head.draft_vocab_size, "train.online": c.online, "train.seed": c.seed,
                "train.batch_size": c.batch_size, "train.batch_tokens": c.batch_tokens,
                "train.max_length": c.max_length}

    def _check_engine(self) -> None:
        acc = self.accelerator
        synced = self.engine in ("DeepSpeedEngine", "DistributedDataParallel")
        stage = None
        if acc.state.deepspeed_plugin is not None:
            stage = acc.state.deepspeed_plugin.deepspeed_config.get("zero_optimization", {}).get("stage")
        trainable = sum(getattr(p, "ds_numel", p.numel()) for p in self.head.parameters() if p.requires_grad)
        acc.print(f"[train] engine={self.engine} zero_stage={stage} world_size={acc.num_processes} "
                  f"device={acc.device} mixed_precision={acc.mixed_precision} target_dtype={self.target_dtype} "
                  f"trainable_params={trainable:,}")
        assert acc.num_processes == 1 or synced, (
            f"{acc.num_processes} processes but engine {self.engine} does not synchronise gradients"
        )

    def count_steps(self, position: Position, step: int) -> int:
        """train.max_steps, or `step` plus the optimizer steps left in the train.epochs epochs from `position`."""
        c = self.config
        if c.max_steps is not None:
            return c.max_steps
        return step + sum(self.plan.steps_in_epoch(e, position.consumed if e == position.epoch else 0)
                          for e in range(position.epoch, c.epochs))

    def loader(self, dataset, batch_sampler, num_workers: int) -> torch.utils.data.DataLoader:
        c = self.config
        return make_loader(dataset, batch_sampler, c.max_length, c.online, num_workers, self.accelerator.device)

    def to_device(self, batch) -> dict[str, torch.Tensor]:
        """A loader's batch on the device; online, the target computes its features first (main process)."""
        device = self.accelerator.device
        if self.config.online:
            batch = collate(with_online_features(batch, self.target, self.aux_layer_ids, device))
        return {k: v.to(device, non_blocking=True) for k, v in batch.items()}

    def validation_batches(self):
        c, acc = self.config, self.accelerator
        batches = epoch_batches(self.val_lengths, 0, 0, c.batch_size, c.batch_tokens, c.max_length)
        mine = rank_batches(batches, acc.process_index, acc.num_processes)[: c.eval_batches]
        for batch in self.loader(self.val_set, mine, num_workers=0):  # a few batches: not worth starting workers
            yield self.to_device(batch)

    def timed(self, part: str):
        """Time `part` of a step into the debug report (device synchronised); a no-op without debug_report."""
        return self.debug.timed(part) if self.debug is not None else contextlib.nullcontext()

    # ------------------------------------------------------------------------------------------ loop
    def run(self) -> Path:
        """Train from the latest checkpoint (or step 0) to total_steps; returns output_dir/final."""
        c, acc = self.config, self.accelerator
        start, position = self.resume()
        self.total_steps = self.count_steps(position, start)
        if c.debug_report:
            self.debug = DebugReport(self)
        log = Logger(self.output_dir, acc.is_main_process, start)
        progress = _progress(self.total_steps, start, acc.is_main_process)
        if start == 0 and self.val_set is not None:  # the untrained baseline the learning curve starts from
            self.write_untrained_eval()
        self.model.train()
        todo = max(0, self.total_steps - start)
        batches = iter(self.loader(self.train_set, PlanSampler(self.plan, position, todo), c.num_workers))
        window = Window(acc.device)
        for step, planned in enumerate(itertools.islice(self.plan.steps(position), todo), start):
            tic, excluded = time.perf_counter(), 0.0  # excluded: validation and checkpoint time
            lr = self.set_lr(step)
            tokens = self.optimizer_step(planned.group, batches, window)
            done = step + 1
            validate = self.val_set is not None and (done % c.eval_every == 0 or done == self.total_steps)
            save = done % c.save_every == 0 or done == self.total_steps
            progress.update(1)
            if validate or save or done % c.log_every == 0 or done == self.total_steps:
                record = {"step": done, "epoch": planned.epoch, "lr": lr, **window.flush(acc)}
                progress.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_s']:.0f}")
                if validate:
                    excluded -= time.perf_counter()
                    record.update(self.validate())
                    excluded += time.perf_counter()
                log.write(record)
            if save:
                excluded -= time.perf_counter()
                save_checkpoint(acc, self.head, self.output_dir, done,
                                {"epoch": planned.after.epoch, "consumed": planned.after.consumed, "lr": lr,
                                 "grad_accum": c.grad_accum, "engine": self.engine, "inputs": self.inputs},
                                keep=c.keep_checkpoints)
                excluded += time.perf_counter()
            window.exclude(excluded)
            if self.debug is not None:
                self.debug.end_step(planned.group, tokens, tic, excluded)
        progress.close()
        log.close()
        return self.finish()

    def resume(self) -> tuple[int, Position]:
        """Drop partial checkpoints; load the latest complete one. Returns the step and data position to start from."""
        acc = self.accelerator
        clean_partial(acc, self.output_dir)
        path = latest_checkpoint(self.output_dir)
        if path is None:
            return 0, Position()
        recorded = json.loads((path / TRAINER_STATE).read_text()).get("inputs")
        changed = differences(recorded, self.inputs) if recorded is not None else []  # (older checkpoints)
        if changed:
            raise DataError(f"{path} was trained on other inputs ({'; '.join(changed)}): restore them to resume, "
                            "or train into another train.output_dir")
        state = load_checkpoint(acc, path, self.model)
        step = state["step"]
        if "consumed" in state:
            position = Position(state["epoch"], state["consumed"])
        elif state["world_size"] == acc.num_processes and state["grad_accum"] == self.config.grad_accum:
            position = next(itertools.islice(self.plan.steps(Position()), step - 1, None)).after  # older checkpoint
        else:
            raise RuntimeError(f"{path} predates world-size independent data positions: resume it with "
                               f"{state['world_size']} processes and grad_accum {state['grad_accum']}")
        acc.print(f"[train] resumed from {path} at step {step} (epoch {position.epoch}, "
                  f"{position.consumed} global micro-batches consumed)")
        return step, position

    def set_lr(self, step: int) -> float:
        lr = lr_at(self.config, step, self.total_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return lr

    def optimizer_step(self, group: list[list[int]], batches, window: Window) -> int:
        """Forward/backward over the grad_accum micro-batches of one step (the next ones of `batches`), then the
        update (inside accumulate). Loss, accuracy and grad norm are summed into `window` on the device (no host
        sync). Returns this rank's token count."""
        c, acc = self.config, self.accelerator
        tokens = 0
        for indices in group:
            items = next(batches)
            with self.timed("features"):  # online: the target's forward; offline: the copy to the device
                batch = self.to_device(items)
            count = sum(min(self.lengths[i], c.max_length or self.lengths[i]) for i in indices)
            tokens += count
            with acc.accumulate(self.model):
                with self.timed("forward"):
                    out = self.model(**batch)
                with self.timed("backward"):
                    acc.backward(out["loss"])
                with self.timed("optimizer"):
                    grad_norm = acc.clip_grad_norm_(self.model.parameters(), c.max_grad_norm) \
                        if acc.sync_gradients else None
                    self.optimizer.step()
                    self.optimizer.zero_grad()
            window.add(out, count, grad_norm)
        return tokens

    def validate(self) -> dict[str, float]:
        """Validation metrics over all ranks, keys prefixed eval_ (the model is back in train mode after)."""
        metrics = evaluate(self.model, self.validation_batches(), lambda t: self.accelerator.reduce(t, "sum"))
        self.model.train()
        return {k if k.startswith("eval_") else f"eval_{k}": v for k, v in metrics.items()}

    def write_untrained_eval(self) -> None:
        metrics = self.validate()
        if self.accelerator.is_main_process:
            atomic_write_json(self.output_dir / "eval_untrained.json", metrics)

    def finish(self) -> Path:
        """Save the final head, the debug report if asked for, and shut the process group down cleanly."""
        acc = self.accelerator
        final = self.output_dir / "final"
        save_head_folder(acc, self.head, final)
        if self.debug is not None:
            self.debug.write()
        acc.print(f"[train] done: {final}")
        acc.wait_for_everyone()  # no rank tears the process group down while another still uses it
        acc.end_training()
        return final


class Window:
    """The training metrics since the last log record, summed on the device: one host sync per record."""

    def __init__(self, device: torch.device):
        self.device = device
        self.reset()

    def reset(self) -> None:
        self.sums = torch.zeros(4, dtype=torch.float64, device=self.device)  # loss, correct_0, count_0, grad_norm
        self.micro_batches = self.norms = self.tokens = 0
        self.started = time.perf_counter()

    def add(self, out: dict, tokens: int, grad_norm) -> None:
        valid = out["valid"][0]  # unroll position 0 only: acc_0 (the full chain statistics are for validation)
        correct = ((out["preds"][0] == out["targets"][0]) & valid).sum()
        norm = torch.zeros((), dtype=torch.float64, device=self.device) if grad_norm is None else \
            torch.as_tensor(grad_norm, device=self.device).double()
        self.sums += torch.stack([out["loss"].detach().double(), correct.double(), valid.sum().double(), norm])
        self.micro_batches += 1
        self.norms += grad_norm is not None
        self.tokens += tokens

    def exclude(self, seconds: float) -> None:
        """Leave `seconds` (validation, checkpoints) out of the window's time."""
        self.started += seconds

    def flush(self, accelerator: Accelerator) -> dict[str, float]:
        """loss (mean over micro-batches and ranks), acc_0, tokens and tokens/s (all ranks), mean grad_norm; then
        start a new window. Collective: every rank flushes at the same steps."""
        packed = accelerator.reduce(torch.cat([self.sums[:3], torch.tensor([float(self.tokens)], dtype=torch.float64,
                                                                           device=self.device)]), "sum")
        loss, correct, count, tokens = packed.tolist()  # the host sync
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        result = {"loss": loss / (accelerator.num_processes * max(self.micro_batches, 1)),
                  "acc_0": correct / max(count, 1.0), "tokens": int(tokens), "tokens_per_s": tokens / elapsed}
        if self.norms:
            result["grad_norm"] = float(self.sums[3]) / self.norms
        self.reset()
        return result


class DebugReport:
    """train.debug_report: ranks/rank-<r>.json with the engine, world size, the sequences this rank trained on,
    full parameter sums when this run starts training (after a resume: the loaded ones) and at its end (gathered
    under ZeRO-3: collective), the draft vocabulary's checksum, peak memory, and per step
    its time (validation and checkpoints left out) and the time of its parts: the batch's features (online: the
    target's forward), the head's forward, backward and optimizer step."""

    PARTS = ("features", "forward", "backward", "optimizer")

    def __init__(self, trainer: Trainer):
        self.trainer = trainer
        self.device = trainer.accelerator.device
        self.seen: list[list[int]] = []
        self.steps: list[dict[str, float]] = []
        self.parts = dict.fromkeys(self.PARTS, 0.0)
        self.initial_param_sums = self.param_sums()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @contextlib.contextmanager
    def timed(self, part: str):
        self._sync()
        tic = time.perf_counter()
        yield
        self._sync()
        self.parts[part] += time.perf_counter() - tic

    def end_step(self, group: list[list[int]], tokens: int, tic: float, excluded: float) -> None:
        self._sync()
        self.seen += group
        self.steps.append({"seconds": time.perf_counter() - tic - excluded, "tokens": tokens, **self.parts})
        self.parts = dict.fromkeys(self.PARTS, 0.0)

    def param_sums(self) -> dict[str, float]:
        """Sum of every trainable head tensor (full, gathered under ZeRO-3). Collective."""
        head = self.trainer.head
        with gathered_params(head):
            return {n: float(p.detach().double().sum()) for n, p in head.named_parameters() if p.requires_grad}

    def write(self) -> None:
        t, acc = self.trainer, self.trainer.accelerator
        report = {"rank": acc.process_index, "world_size": acc.num_processes, "engine": t.engine,
                  "mixed_precision": acc.mixed_precision, "device": str(self.device), "seen": self.seen,
                  "param_sums": self.param_sums(), "initial_param_sums": self.initial_param_sums,
                  "d2t_checksum": checksum(t.head.d2t) if t.head.eagle3 else None,
                  "rotary_dtypes": {n: str(b.dtype) for n, b in rotary_frequencies(t.head).items()},
                  "peak_rss_mb": _peak_rss_mb(), "steps": self.steps, "config": asdict(t.config)}
        if self.device.type == "cuda":
            report["peak_cuda_mb"] = torch.cuda.max_memory_allocated(self.device) / 2**20
        path = t.output_dir / "ranks" / f"rank-{acc.process_index}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report) + "\n")


def _peak_rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def _progress(total: int, initial: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, disable=not enabled, desc="train", dynamic_ncols=True)


class Logger:
    """log.jsonl (truncated to the resume step on restart) + TensorBoard, rank 0 only."""

    def __init__(self, output_dir: Path, enabled: bool, start_step: int):
        self.enabled = enabled
        self.path = output_dir / "log.jsonl"
        self.tb = None
        if not enabled:
            return
        if self.path.exists():  # drop records of steps a killed run did after its last checkpoint
            kept = [line for line in self.path.read_text().splitlines()
                    if line.strip() and json.loads(line)["step"] <= start_step]
            self.path.write_text("".join(line + "\n" for line in kept))
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(output_dir / "tensorboard"))
        except ImportError:  # tensorboard is optional at run time
            self.tb = None

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self.tb is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self.tb.add_scalar(key, value, record["step"])

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


def train(recipe: Recipe | dict) -> Path:
    """Train a head as the recipe says; returns output_dir/final."""
    return Trainer(recipe).run()
