"""The training loop: accelerate (DeepSpeed ZeRO 0-3 or DDP, or one process), EAGLE-3 TTT or EAGLE-1 loss.

    accelerate launch [--config_file configs/accelerate/<x>.yaml] -m train RECIPE [key=value ...]
    python -m train RECIPE                       # one process

One optimizer step = grad_accum micro-batches per rank. Every rank reads its own micro-batches of a
deterministic epoch order (train.batches), so a resumed run continues exactly where the checkpoint was taken.
Re-running the same command resumes from the latest complete checkpoint in train.output_dir.
"""

from __future__ import annotations

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
from drafthead.utils import atomic_write_json, mixed_precision
from drafthead.vocab import build_draft_vocab, full_vocab, token_frequencies
from train.batches import PreparedSequences, collate, epoch_batches, rank_batches, with_online_features
from train.evaluate import evaluate, step_statistics
from train.features import FeatureDataset
from train.loss import DraftTrainModule
from train.recipe import Recipe, TrainSection, parse_recipe
from train.state import clean_partial, gathered_params, latest_checkpoint, load_checkpoint, save_checkpoint, \
    save_head_folder
from train.target import load_target, target_config_hash, target_name


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
        raise ValueError(
            f"features in {features.folder} hold aux layers {manifest['aux_layer_ids']}, the recipe's head wants "
            f"{list(aux)}: set head.aux_layer_ids to match or re-collect the features"
        )
    expected = target_config_hash(recipe.target)
    if manifest.get("target_config_hash", expected) != expected:
        raise ValueError(f"features in {features.folder} were collected from another target "
                         f"(config hash {manifest['target_config_hash']} != {expected})")


def build_head(recipe: Recipe, target, train_set) -> DraftHead:
    """Head shaped after the target, aux ids checked against the features, draft vocab from the train tokens;
    or, with head.init_from, the weights, aux layers and draft vocabulary of an existing head (fine-tuning)."""
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
    if head.eagle3:
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
    trained on, full parameter sums before and after, peak RSS) into output_dir/ranks/rank-<r>.json; without
    it none of that is kept or computed.
    """

    def __init__(self, recipe: Recipe | dict):
        self.recipe = recipe = parse_recipe(recipe)
        self.config = config = recipe.train
        # Load the frozen target before the Accelerator exists: under a ZeRO-3 launch transformers would
        # otherwise partition it (zero.Init), and the head copies its embedding / norm / lm_head.
        target = load_target(recipe.target, device="cpu", dtype=recipe.dtype if config.online else "float32")
        self.accelerator = acc = make_accelerator(config)
        self.output_dir = Path(config.output_dir)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        set_seed(config.seed)  # identical head init on every rank
        device = acc.device
        self.train_set = _open_split(recipe, "train")
        self.val_set = _open_split(recipe, "validation")
        target = target.to(device)
        head = build_head(recipe, target, self.train_set)
        self.target = target if config.online else None  # offline: only the borrowed modules are kept
        self.aux_layer_ids = head.config.aux_layer_ids
        module = DraftTrainModule(head, target, config.ttt_steps, config.ttt_decay, config.feature_noise).to(device)
        if not config.online:
            del target
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
        self.lengths = self.train_set.lengths()
        self.total_steps = config.max_steps or sum(self._steps_in_epoch(e) for e in range(config.epochs))
        self.debug: DebugReport | None = DebugReport(self) if config.debug_report else None

    # ------------------------------------------------------------------------------------------ setup
    def _check_engine(self) -> None:
        acc = self.accelerator
        synced = self.engine in ("DeepSpeedEngine", "DistributedDataParallel")
        stage = None
        if acc.state.deepspeed_plugin is not None:
            stage = acc.state.deepspeed_plugin.deepspeed_config.get("zero_optimization", {}).get("stage")
        trainable = sum(getattr(p, "ds_numel", p.numel()) for p in self.head.parameters() if p.requires_grad)
        acc.print(f"[train] engine={self.engine} zero_stage={stage} world_size={acc.num_processes} "
                  f"device={acc.device} mixed_precision={acc.mixed_precision} "
                  f"trainable_params={trainable:,}")
        assert acc.num_processes == 1 or synced, (
            f"{acc.num_processes} processes but engine {self.engine} does not synchronise gradients"
        )

    def _rank_epoch(self, epoch: int, lengths: list[int] | None = None, seed: int | None = None) -> list[list[int]]:
        c, acc = self.config, self.accelerator
        batches = epoch_batches(self.lengths if lengths is None else lengths, c.seed if seed is None else seed, epoch,
                                c.batch_size, c.batch_tokens if not c.batch_size else None, c.max_length)
        return rank_batches(batches, acc.process_index, acc.num_processes)

    def _steps_in_epoch(self, epoch: int) -> int:
        steps = len(self._rank_epoch(epoch)) // self.config.grad_accum
        if steps == 0:
            raise ValueError("an epoch has fewer micro-batches than train.grad_accum: add data or shrink batches")
        return steps

    def step_groups(self, start: int):
        """Yield (step, epoch, [grad_accum micro-batches of sequence indices]) from optimizer step `start`."""
        step, epoch = 0, 0
        while True:
            batches = self._rank_epoch(epoch)
            n = self._steps_in_epoch(epoch)
            for s in range(max(0, start - step), n):
                yield step + s, epoch, batches[s * self.config.grad_accum : (s + 1) * self.config.grad_accum]
            step, epoch = step + n, epoch + 1

    def load_batch(self, dataset, indices: list[int]) -> dict[str, torch.Tensor]:
        c = self.config
        items = [dataset[i] for i in indices]
        if c.max_length:
            items = [{k: v[: c.max_length] for k, v in item.items()} for item in items]
        if c.online:
            items = with_online_features(items, self.target, self.aux_layer_ids, self.accelerator.device)
        return {k: v.to(self.accelerator.device) for k, v in collate(items).items()}

    def validation_batches(self):
        batches = self._rank_epoch(0, self.val_set.lengths(), seed=0)
        for indices in batches[: self.config.eval_batches]:
            yield self.load_batch(self.val_set, indices)

    # ------------------------------------------------------------------------------------------ loop
    def run(self) -> Path:
        """Train from the latest checkpoint (or step 0) to total_steps; returns output_dir/final."""
        start = self.resume()
        log = Logger(self.output_dir, self.accelerator.is_main_process, start)
        progress = _progress(self.total_steps, start, self.accelerator.is_main_process)
        if start == 0 and self.val_set is not None:  # the untrained baseline the learning curve starts from
            self.write_untrained_eval()
        self.model.train()
        tic = time.perf_counter()
        for step, epoch, group in self.step_groups(start):
            if step >= self.total_steps:
                break
            lr = self.set_lr(step)
            result = self.optimizer_step(group)
            elapsed, tic = time.perf_counter() - tic, time.perf_counter()
            record = {"step": step + 1, "epoch": epoch, "loss": result.pop("loss"), "lr": lr,
                      "acc_0": result.pop("acc_0"), "tokens": result["tokens"],
                      "tokens_per_s": result.pop("tokens") / max(elapsed, 1e-9), **result}  # + grad_norm
            done = step + 1
            if self.val_set is not None and (done % self.config.eval_every == 0 or done == self.total_steps):
                record.update(self.validate())
            log.write(record)
            progress.update(1)
            progress.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_s']:.0f}")
            if done % self.config.save_every == 0 or done == self.total_steps:
                save_checkpoint(self.accelerator, self.head, self.output_dir, done,
                                {"epoch": epoch, "lr": lr, "grad_accum": self.config.grad_accum},
                                keep=self.config.keep_checkpoints)
        progress.close()
        log.close()
        return self.finish()

    def resume(self) -> int:
        """Drop partial checkpoints; load the latest complete one. Returns the step to start from."""
        acc = self.accelerator
        clean_partial(acc, self.output_dir)
        resume = latest_checkpoint(self.output_dir)
        if resume is None:
            return 0
        start = load_checkpoint(acc, resume)["step"]
        acc.print(f"[train] resumed from {resume} at step {start}")
        return start

    def set_lr(self, step: int) -> float:
        lr = lr_at(self.config, step, self.total_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return lr

    def optimizer_step(self, group: list[list[int]]) -> dict[str, float]:
        """Forward/backward over the grad_accum micro-batches of one step, then the update (inside accumulate).
        Returns loss (mean over micro-batches and ranks), acc_0, tokens (all ranks) and grad_norm."""
        c, acc = self.config, self.accelerator
        losses, tokens, stats, grad_norm = [], 0, None, None
        for indices in group:
            if self.debug is not None:
                self.debug.seen.append(indices)
            batch = self.load_batch(self.train_set, indices)
            tokens += sum(min(self.lengths[i], c.max_length or self.lengths[i]) for i in indices)
            with acc.accumulate(self.model):
                out = self.model(**batch)
                acc.backward(out["loss"])
                grad_norm = acc.clip_grad_norm_(self.model.parameters(), c.max_grad_norm) \
                    if acc.sync_gradients else None
                self.optimizer.step()
                self.optimizer.zero_grad()
            losses.append(out["loss"].detach().float())
            s = step_statistics({k: [t.detach() for t in v] if isinstance(v, list) else v
                                 for k, v in out.items()}, batch["input_ids"])
            stats = s if stats is None else {k: stats[k] + s[k] for k in s}
        packed = torch.cat([torch.stack(losses).mean().reshape(1).double(), stats["correct"][:1],
                            stats["count"][:1], torch.tensor([tokens], dtype=torch.float64, device=acc.device)])
        packed = acc.reduce(packed, "sum")
        result = {"loss": float(packed[0]) / acc.num_processes, "acc_0": float(packed[1] / packed[2].clamp(min=1)),
                  "tokens": int(packed[3])}
        if grad_norm is not None:
            result["grad_norm"] = float(grad_norm)
        return result

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


class DebugReport:
    """train.debug_report: ranks/rank-<r>.json with the engine, world size, the sequences this rank trained on,
    and full parameter sums before and after training (gathered under ZeRO-3: collective)."""

    def __init__(self, trainer: Trainer):
        self.trainer = trainer
        self.seen: list[list[int]] = []
        self.initial_param_sums = self.param_sums()

    def param_sums(self) -> dict[str, float]:
        """Sum of every trainable head tensor (full, gathered under ZeRO-3). Collective."""
        head = self.trainer.head
        with gathered_params(head):
            return {n: float(p.detach().double().sum()) for n, p in head.named_parameters() if p.requires_grad}

    def write(self) -> None:
        t, acc = self.trainer, self.trainer.accelerator
        report = {"rank": acc.process_index, "world_size": acc.num_processes, "engine": t.engine,
                  "mixed_precision": acc.mixed_precision, "seen": self.seen, "param_sums": self.param_sums(),
                  "initial_param_sums": self.initial_param_sums, "peak_rss_mb": _peak_rss_mb(),
                  "config": asdict(t.config)}
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
