"""Pretrain the OCR miniature: a tiny Qwen-Image pipeline that learns to write words, on CPU.

    python tools/pretrain_tiny_text.py --out examples/tiny/text_pipeline --seed 0
    torchrun --nproc-per-node 2 tools/pretrain_tiny_text.py --out /tmp/text_pipeline --tp 2

1. Renders the synthetic dataset (`model_providers/ocr_miniature/text_dataset.py`: words of a fixed vocabulary
   in DejaVu Sans Bold, random position, size and colours; --max-offset, --offset-step, --font-sizes and
   --colours narrow them: words moved by whole 8 px image tokens learn about 10x faster than words placed
   anywhere, docs/recipes.md). `--space latent` trains the pipeline's VAE on
   it (`AutoencoderKLQwenImage`, scale 4, 16 channels; a deterministic autoencoder: the posterior mean, a
   little latent noise for a decoder that tolerates imperfect samples); `--space pixel` puts a
   `PixelShuffleVAE` in its place (grayscale pixels folded 4 x 4 into the same 16 channels, exactly; nothing
   to train). The latent mean/std per channel go into the VAE config, as Qwen-Image's do.
2. Flow-matching pretraining of the transformer as our Megatron-Core model (`model_providers/qwen_image`,
   TP from --tp, data parallel over the remaining ranks) through Megatron-Core's DDP and optimizer:
   x_t = (1 - s) x_0 + s e, target e - x_0, s drawn through the pipeline's own shifted schedule; prompts
   are dropped to the negative prompt 10% of the time so true CFG works. `--text-encoder train` trains the
   pipeline's tiny text encoder with it (plain Adam at the transformer's learning rate; Qwen-Image's encoder
   comes pretrained, a random one's features are a fixed random code of the characters); by default it
   stays as seeded, as in the shipped pipeline. `--vae-from DIR` reuses another folder's trained VAE and
   skips step 1.
3. Every --eval-every steps the weights go through the bridge into a diffusers rollout engine, which
   samples the vocabulary with the ODE (--eval-steps, guidance --guidance) and the OCR reader scores the
   images. Training stops at the first evaluation whose OCR similarity reaches --stop-ocr (partly legible:
   RL has room) or at --max-steps.
4. The pipeline folder (diffusers layout, loadable offline) is written atomically to --out with
   `pretrain.json` beside the weights: the command, seed, steps, OCR similarity and wall time. SIGINT
   (Ctrl-C) or SIGTERM writes the model of the last evaluation instead.

`--init-from DIR` continues from a pipeline folder this tool wrote (its VAE, latent statistics and
transformer; fresh optimizer state), recording the earlier run's `pretrain.json` under `previous`. A
constant-lr run's weights are noisy (its evaluations jump by +-0.05); a last `--init-from` run with
`--lr-decay linear` (to 0 over --max-steps) consolidates them.

Everything random is drawn from --seed, so the same command on the same software stack rebuilds the same
folder (one process per rank, CPU fp32).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from tqdm import tqdm  # noqa: E402

from model_providers.ocr_miniature.text_dataset import (  # noqa: E402
    FONT_SIZES,
    VARIED,
    VOCABULARY,
    TextLayout,
    images_to_tensor,
    prompt_for,
    render_dataset,
)
from model_providers.ocr_miniature.text_miniature import MINIATURE  # noqa: E402
from model_providers.qwen_image.tiny_pipeline import build_components, save_pipeline_atomically  # noqa: E402

NEGATIVE_PROMPT = " "


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="pipeline folder to write (must not exist unless --overwrite)")
    ap.add_argument("--overwrite", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--init-from", default=None,
                    help="continue from this pipeline folder (its VAE and transformer) instead of starting anew")
    ap.add_argument("--vae-from", default=None,
                    help="take this pipeline folder's trained VAE (and latent statistics) instead of training one; "
                         "the transformer and text encoder still start from --seed")
    ap.add_argument("--space", choices=("latent", "pixel"), default=None,
                    help="latent (default): train a scale-4 AutoencoderKLQwenImage on the dataset; pixel: "
                         "PixelShuffleVAE, 64 px grayscale folded into 16 x 16 x 16 latents exactly (no VAE to "
                         "train); with --init-from/--vae-from, recorded as that folder's")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size of the transformer")
    ap.add_argument("--text-encoder", choices=("train", "frozen"), default="frozen",
                    help="keep the seeded tiny text encoder (the shipped pipeline's) or train it with the "
                         "transformer (a random encoder's features are a fixed random code of the characters)")
    ap.add_argument("--vae-steps", type=int, default=700)
    ap.add_argument("--vae-batch", type=int, default=32)
    ap.add_argument("--vae-crop", type=int, default=32, help="VAE training crop (px, multiple of 4)")
    ap.add_argument("--vae-lr", type=float, default=2e-3)
    ap.add_argument("--dataset-size", type=int, default=8192, help="rendered images the transformer learns")
    ap.add_argument("--max-offset", default=None,
                    help="dataset: 'any' (a word anywhere inside a 3 px margin) or the most pixels it moves from "
                         "the centre per axis (0: centred); default any, or the --init-from folder's")
    ap.add_argument("--offset-step", type=int, default=None,
                    help="dataset: offsets from the centre are multiples of it (8: whole image tokens); default 1, "
                         "or the --init-from folder's")
    ap.add_argument("--font-sizes", type=int, nargs="+", default=None,
                    help="dataset: font sizes (px) drawn from, DejaVu Sans Bold's cap height is ~0.73 of the size; "
                         f"default {' '.join(map(str, FONT_SIZES))}, or the --init-from folder's")
    ap.add_argument("--colours", choices=("random", "fixed"), default=None,
                    help="dataset: random light background and dark ink, or black on white; default random, or "
                         "the --init-from folder's")
    ap.add_argument("--max-steps", type=int, default=8000, help="transformer steps at most")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--lr-decay", choices=("constant", "linear", "cosine"), default="constant",
                    help="learning-rate schedule over --max-steps (linear/cosine: to 0, the decay phase of a "
                         "warmup-stable-decay run, which consolidates a constant-lr run's noisy weights)")
    ap.add_argument("--drop-prompt", type=float, default=0.1, help="share of prompts replaced by the negative one")
    ap.add_argument("--eval-every", type=int, default=250)
    ap.add_argument("--eval-steps", type=int, default=20, help="ODE sampling steps of the evaluation")
    ap.add_argument("--guidance", type=float, default=3.0)
    ap.add_argument("--stop-ocr", type=float, default=0.25, help="stop once the vocabulary's OCR similarity reaches it")
    args = ap.parse_args(argv)
    if args.init_from and args.vae_from:
        ap.error("--init-from already brings its VAE: drop --vae-from")
    if args.space is not None and (args.init_from or args.vae_from):
        ap.error("--init-from and --vae-from bring their folder's VAE (latent or pixel): drop --space")
    try:
        layout_of(args)
    except ValueError as err:
        ap.error(str(err))
    return args


def layout_of(args: argparse.Namespace, base: TextLayout = VARIED) -> TextLayout:
    """The dataset layout: --max-offset, --offset-step, --font-sizes and --colours where given, `base`'s
    otherwise."""
    offset = base.max_offset
    if args.max_offset is not None:
        if args.max_offset == "any":
            offset = None
        elif not args.max_offset.isdigit():
            raise ValueError(f"--max-offset must be 'any' or a whole number of pixels >= 0, not {args.max_offset!r}")
        else:
            offset = int(args.max_offset)
    return TextLayout(offset, tuple(args.font_sizes) if args.font_sizes else base.font_sizes,
                      args.colours or base.colours,
                      base.offset_step if args.offset_step is None else args.offset_step)


def recorded_layout(record: dict | None) -> TextLayout:
    """The layout a pretrain.json records (a record without one predates the option: the varied default)."""
    if not record or "layout" not in record:
        return VARIED
    return TextLayout(**{**record["layout"], "font_sizes": tuple(record["layout"]["font_sizes"])})


# ----------------------------------------------------------------------------------------------- VAE


def train_vae(vae: torch.nn.Module, images: torch.Tensor, steps: int, batch: int, crop: int, lr: float,
              seed: int) -> float:
    """Train `vae` on random `crop` x `crop` crops of images [N, 3, 1, H, W] in [-1, 1] as a deterministic
    autoencoder (L1 + L2 on the reconstruction of the posterior mean plus 5% latent noise; crops are 4x
    cheaper than whole images and the strokes are local); returns the last step's MSE."""
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(vae.parameters(), lr=lr)
    vae.train()
    mse = float("nan")
    for _ in tqdm(range(steps), desc="VAE", unit="step", dynamic_ncols=True):
        x = images[torch.randint(0, len(images), (batch,), generator=gen)]
        ox, oy = (torch.randint(0, (images.shape[-1] - crop) // 4 + 1, (2,), generator=gen) * 4).tolist()
        x = x[..., oy: oy + crop, ox: ox + crop]
        z = vae.encode(x).latent_dist.mode()
        z = z + 0.05 * torch.randn(z.shape, generator=gen)
        rec = vae.decode(z).sample
        loss = (rec - x).pow(2).mean() + (rec - x).abs().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        mse = float((rec - x).detach().pow(2).mean())
    vae.eval()
    return mse


@torch.no_grad()
def encode_latents(vae: torch.nn.Module, images: torch.Tensor, chunk: int = 256) -> torch.Tensor:
    """images [N, 3, 1, H, W] -> posterior means [N, z, 1, H / s, W / s]."""
    return torch.cat([vae.encode(images[i: i + chunk]).latent_dist.mode() for i in range(0, len(images), chunk)])


def pack(latents: torch.Tensor) -> torch.Tensor:
    """[N, C, 1, h, w] -> [N, (h / 2) (w / 2), 4 C], the pipeline's own 2 x 2 patch packing."""
    from diffusers import QwenImagePipeline

    n, c, _, h, w = latents.shape
    return QwenImagePipeline._pack_latents(latents[:, :, 0], n, c, h, w)


def _space_of(vae: torch.nn.Module) -> str:
    from model_providers.ocr_miniature.pixel_vae import PixelShuffleVAE

    return "pixel" if isinstance(vae, PixelShuffleVAE) else "latent"


def build_vae_and_latents(args: argparse.Namespace, work: Path) -> dict:
    """Rank 0: the pipeline to start from in `work/pipeline` and `work/latents.pt` (normalised packed latents
    and word ids). New: untrained components from the seed, the VAE trained here (or the PixelShuffleVAE of
    --space pixel; or --vae-from's folder's VAE), its latent statistics in its config. With --init-from:
    that folder's components as they are (its transformer continues; its VAE and latent statistics are
    kept, since the transformer learned in their latent space; the dataset layout is the folder's unless
    flags change it). Returns what to record about the start, with the dataset layout under "layout"."""
    from diffusers import QwenImagePipeline

    layout = layout_of(args)
    if args.init_from:
        pipe = QwenImagePipeline.from_pretrained(args.init_from, local_files_only=True)
        components = dict(pipe.components)
        vae = components["vae"].eval()
        previous = Path(args.init_from) / "pretrain.json"
        start = {"init_from": str(args.init_from),
                 "previous": json.loads(previous.read_text()) if previous.exists() else None}
        mse = start["previous"]["vae_mse"] if start["previous"] else float("nan")
        layout = layout_of(args, base=recorded_layout(start["previous"]))
    elif args.vae_from:
        components = build_components(MINIATURE, args.seed)
        # Whatever VAE class the folder names (a trained AutoencoderKLQwenImage or a PixelShuffleVAE).
        vae = components["vae"] = QwenImagePipeline.from_pretrained(args.vae_from, local_files_only=True).vae.eval()
        source = Path(args.vae_from) / "pretrain.json"
        source_record = json.loads(source.read_text()) if source.exists() else None
        mse = source_record["vae_mse"] if source_record else float("nan")
        # The VAE's provenance: the record of the run that trained it (and the runs that one continued).
        start = {"init_from": None, "vae_from": str(args.vae_from), "vae_source": source_record}
    elif args.space == "pixel":
        from model_providers.ocr_miniature.pixel_vae import PixelShuffleVAE

        components = build_components(MINIATURE, args.seed)
        vae = components["vae"] = PixelShuffleVAE(scale=4, z_dim=components["vae"].config.z_dim)
        vae_images, _ = render_dataset(VOCABULARY, 512, seed=args.seed * 1000 + 1, layout=layout)
        x = torch.from_numpy(images_to_tensor(vae_images)).unsqueeze(2)
        mse = float(torch.nn.functional.mse_loss(vae.decode(vae.encode(x).latent_dist.mode()).sample, x))
        start = {"init_from": None}
    else:
        components = build_components(MINIATURE, args.seed)
        vae = components["vae"]
        vae_images, _ = render_dataset(VOCABULARY, 4096, seed=args.seed * 1000 + 1, layout=layout)
        x = torch.from_numpy(images_to_tensor(vae_images)).unsqueeze(2)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(args.seed * 1000 + 2)
            mse = train_vae(vae, x, args.vae_steps, args.vae_batch, args.vae_crop, args.vae_lr,
                            args.seed * 1000 + 3)
        start = {"init_from": None}
    args.space = _space_of(vae)  # recorded in pretrain.json: the space this run trained in, however chosen
    images, words = render_dataset(VOCABULARY, args.dataset_size, seed=args.seed * 1000 + 4, layout=layout)
    start["layout"] = dataclasses.asdict(layout)  # read back by recorded_layout
    z = encode_latents(vae, torch.from_numpy(images_to_tensor(images)).unsqueeze(2))
    if not (args.init_from or args.vae_from):
        vae.register_to_config(latents_mean=[float(v) for v in z.mean(dim=(0, 2, 3, 4))],
                               latents_std=[float(v) for v in z.std(dim=(0, 2, 3, 4))])
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
    word_ids = torch.tensor([VOCABULARY.index(w) for w in words])
    QwenImagePipeline(**components).save_pretrained(work / "pipeline", safe_serialization=True)
    torch.save({"latents": pack((z - mean) / std), "word_ids": word_ids, "vae_mse": mse}, work / "latents.pt")
    print(f"VAE: reconstruction MSE {mse:.4f} (images in [-1, 1]); {len(images)} training latents")
    return start


# ------------------------------------------------------------------------------------------ transformer


def conditioning(engine, keys: list[tuple[int, ...]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Text embeddings of templated prompts (`engine.token_ids`) as the pipeline computes them, padded and
    differentiable under autograd: ([P, L, D] fp32, [P, L] long mask)."""
    from megatron_omni.algorithms.velocity import pad_text

    return pad_text([e.float() for e in engine.encode_token_ids(keys)])


class TextEncoderTrainer:
    """Adam on the pipeline's tiny text encoder beside the transformer's Megatron optimizer: same learning
    rate (read from the Megatron scheduler every step), gradients averaged over data-parallel ranks (tensor
    ranks already hold equal ones: the transformer's column-parallel input all-reduces them) and clipped
    at 1.0 like the transformer's."""

    def __init__(self, text_encoder: torch.nn.Module, dp_group, lr: float) -> None:
        self.params = list(text_encoder.requires_grad_(True).parameters())
        self.dp_group = dp_group
        self.optimizer = torch.optim.Adam(self.params, lr=lr)

    def step(self, lr: float) -> None:
        """Average, clip and apply the gradients of the last backward at learning rate `lr`."""
        if self.dp_group.size() > 1:
            for p in self.params:
                if p.grad is not None:
                    dist.all_reduce(p.grad, group=self.dp_group)
                    p.grad /= self.dp_group.size()
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def train_sigmas(n: int, image_seq_len: int, scheduler_config, gen: torch.Generator) -> torch.Tensor:
    """[n] noise levels: uniform draws pushed through the pipeline's resolution shift (the density its
    sampling grid has), so training spends its steps where sampling does."""
    from megatron_omni.algorithms.schedule import ShiftConfig, shift_sigmas

    u = torch.rand(n, generator=gen).clamp(1e-4, 1 - 1e-4)
    return shift_sigmas(u, image_seq_len, ShiftConfig.from_scheduler_config(scheduler_config))


def eval_ocr(engine, reward_fn, guidance: float, steps: int, seed: int) -> tuple[float, torch.Tensor]:
    """OCR similarity of one ODE sample per vocabulary word (fixed seeds) and the images [V, 3, H, W]."""
    from megatron_omni.rollout.base import SamplingParams
    from megatron_omni.trainer.evaluation import evaluate

    prompts = [prompt_for(w) for w in VOCABULARY]
    params = SamplingParams(height=64, width=64, num_steps=steps, noise_level=0.0, guidance_scale=guidance,
                            negative_prompt=NEGATIVE_PROMPT if guidance > 1 else None)
    result = evaluate(engine, reward_fn, prompts, [seed * 1000 + i for i in range(len(prompts))], params)
    return result.mean(), result.images


class EvaluatedWeights:
    """A copy of the engine's transformer and text encoder as the last finished evaluation scored them. An
    interrupt can land anywhere (after the next sync, during its sampling, mid-way through a text-encoder
    step); restoring this copy makes the written folder the model that `history[-1]` describes."""

    def __init__(self) -> None:
        self.state: dict[str, dict[str, torch.Tensor]] | None = None

    def take(self, engine) -> None:
        self.state = {name: {k: v.detach().clone() for k, v in getattr(engine.pipe, name).state_dict().items()}
                      for name in ("transformer", "text_encoder")}

    def restore(self, engine) -> None:
        if self.state is not None:
            for name, state in self.state.items():
                getattr(engine.pipe, name).load_state_dict(state)


def pretrain_transformer(args: argparse.Namespace, groups, engine, data: dict, work: Path,
                         history: list[dict], started: float) -> tuple[int, float]:
    """The flow-matching loop on the Megatron model; evaluations append to `history` (rank 0). Returns the
    last step and the OCR similarity of the last evaluation. The engine holds the weights of the last
    evaluation (the only time they are synced; an interrupt restores them there)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from megatron_omni.bridge import DiffusersTarget, WeightSync
    from megatron_omni.bridge.qwen_image import megatron_sources, qwen_image_plan
    from megatron_omni.models.dit.model import DiTBatch
    from megatron_omni.parallel import platform
    from megatron_omni.trainer.metrics import save_image_grid
    from megatron_omni.trainer.rewards import RewardFunction
    from model_providers.qwen_image import provider

    rank = dist.get_rank()
    keys = [engine.token_ids(p) for p in [prompt_for(w) for w in VOCABULARY] + [NEGATIVE_PROMPT]]
    negative = len(VOCABULARY)
    text_trainer = TextEncoderTrainer(engine.pipe.text_encoder, groups.dp, args.lr) \
        if args.text_encoder == "train" else None
    with torch.no_grad():  # a trained text encoder's are recomputed every step instead
        cond, cond_mask = conditioning(engine, keys)
    platform.seed_everything(args.seed, tp_rank=groups.tp.rank())
    mcfg = provider.transformer_config(dict(engine.transformer.config), tp=args.tp)
    model = provider.build_model(mcfg, groups)
    provider.load_hf_state_dict(model, engine.transformer.state_dict())
    ddp = DistributedDataParallel(config=mcfg, module=model, pg_collection=groups.mcore,
                                  ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True))
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=args.lr, min_lr=0.0, weight_decay=0.0, clip_grad=1.0,
                        params_dtype=mcfg.params_dtype),
        [ddp], use_gloo_process_groups=False, pg_collection=groups.mcore)
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=args.lr, max_lr=args.lr, min_lr=0.0, lr_warmup_steps=0, lr_decay_steps=args.max_steps,
        lr_decay_style=args.lr_decay, start_wd=0.0, end_wd=0.0, wd_incr_steps=args.max_steps,
        wd_incr_style="constant")
    plan = qwen_image_plan(dict(engine.transformer.config), trainer_tp=args.tp, trainer_pp=1,
                           rollout_kind="diffusers", rollout_tp=1, mode="full")
    sync = WeightSync(plan, sources=megatron_sources(model), target=DiffusersTarget(engine.transformer),
                      tp_group=groups.tp, tp_rank=groups.tp.rank(), stage=0)
    reward_fn = RewardFunction("ocr") if rank == 0 else None

    latents, word_ids = data["latents"], data["word_ids"]
    s_img = latents.shape[1]
    side = int(round(s_img ** 0.5))
    dp, dp_rank = groups.dp.size(), groups.dp.rank()
    if args.batch_size % dp:
        raise ValueError(f"--batch-size {args.batch_size} is not divisible by {dp} data-parallel ranks")
    gen = torch.Generator().manual_seed(args.seed * 1000 + 5)
    step, ocr = 0, 0.0
    evaluated = EvaluatedWeights()
    bar = tqdm(total=args.max_steps, desc="transformer", unit="step", disable=rank != 0, dynamic_ncols=True)
    try:
        while step < args.max_steps:
            if _SIGNALLED:
                raise KeyboardInterrupt(f"signal {_SIGNALLED[0]}")
            # Every rank draws the whole batch (same generator) and keeps its data-parallel slice.
            idx = torch.randint(0, len(latents), (args.batch_size,), generator=gen)
            drop = torch.rand(args.batch_size, generator=gen) < args.drop_prompt
            sigma = train_sigmas(args.batch_size, s_img, engine.pipe.scheduler.config, gen)
            noise = torch.randn(latents[idx].shape, generator=gen)
            mine = slice(dp_rank * args.batch_size // dp, (dp_rank + 1) * args.batch_size // dp)
            x0, e, s = latents[idx][mine], noise[mine], sigma[mine]
            rows = torch.where(drop, negative, word_ids[idx])[mine]
            xt = (1 - s.view(-1, 1, 1)) * x0 + s.view(-1, 1, 1) * e
            ddp.zero_grad_buffer()
            optimizer.zero_grad()
            if text_trainer is not None:
                cond, cond_mask = conditioning(engine, keys)
            v = ddp(DiTBatch(xt, cond[rows], cond_mask[rows], s, (1, side, side)))
            loss = (v - (e - x0)).pow(2).mean()
            loss.backward()
            finalize_model_grads([ddp], pg_collection=groups.mcore)
            if text_trainer is not None:
                # Before the scheduler moves on: this step's learning rate, as the transformer's.
                text_trainer.step(optimizer.param_groups[0]["lr"])
            optimizer.step()
            scheduler.step(increment=1)
            step += 1
            bar.update(1)
            bar.set_postfix(loss=f"{float(loss):.4f}", ocr=f"{ocr:.3f}", lr=f"{optimizer.param_groups[0]['lr']:.1e}")
            if step % args.eval_every == 0 or step == args.max_steps:
                sync.sync()
                engine.clear_prompt_cache()
                verdict = [None]
                if rank == 0:
                    ocr, images = eval_ocr(engine, reward_fn, args.guidance, args.eval_steps, args.seed)
                    save_image_grid(images, list(VOCABULARY), work / f"samples_{step:05d}.png", columns=8)
                    entry = {"step": step, "ocr": ocr, "loss": float(loss), "minutes": (time.time() - started) / 60}
                    evaluated.take(engine)
                    history.append(entry)
                    tqdm.write(f"step {step}: OCR similarity {ocr:.3f} (loss {float(loss):.4f}, "
                               f"{history[-1]['minutes']:.1f} min)")
                    verdict = [ocr]
                dist.broadcast_object_list(verdict, src=0)
                ocr = verdict[0]
                if ocr >= args.stop_ocr:
                    break
    except KeyboardInterrupt:
        evaluated.restore(engine)
        raise
    finally:
        bar.close()
        if reward_fn is not None:
            reward_fn.close()
    return step, ocr


def write_pipeline(engine, out: Path, work: Path, record: dict) -> None:
    """The engine's pipeline (VAE, text encoder, tokenizer, scheduler, transformer), `pretrain.json` and the
    last evaluation's samples into `out`, atomically."""
    extra: dict[str, str | Path] = {"pretrain.json": json.dumps(record, indent=2) + "\n"}
    if record["history"]:
        extra["samples.png"] = work / f"samples_{record['history'][-1]['step']:05d}.png"
    save_pipeline_atomically(engine.pipe, out, extra)


_SIGNALLED: list[int] = []  # the signals seen; the training loop re-raises at its next step while one is here


def _stop_on_signals() -> None:
    """SIGINT and SIGTERM raise KeyboardInterrupt, so both keep the last evaluated model (a shell starts
    background jobs with SIGINT ignored, and schedulers stop jobs with SIGTERM). The signal is also recorded:
    a handler's exception that lands while Python runs a finalizer is printed and dropped ("Exception ignored
    in ..."), and the run would then train on past the signal; the loop checks the record at every step."""
    def _raise(signum, frame):
        _SIGNALLED.append(signum)
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGINT, _raise)
    signal.signal(signal.SIGTERM, _raise)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    if out.exists() and not args.overwrite:  # refused before the heavy imports (Megatron, diffusers): at once
        print(f"error: {out} exists (pass --overwrite to replace it)", file=sys.stderr)
        return 2
    _stop_on_signals()  # once there is a run to stop (a refusal leaves the caller's handlers alone)
    from megatron_omni.parallel import ParallelLayout, build_parallel_groups, platform
    from megatron_omni.rollout.diffusers_engines.engine import DiffusersRolloutEngine

    platform.init_distributed()
    rank, started = dist.get_rank(), time.time()
    groups = build_parallel_groups(ParallelLayout(tp=args.tp))
    out.parent.mkdir(parents=True, exist_ok=True)
    work_list = [tempfile.mkdtemp(prefix=f".{out.name}.work.", dir=out.parent) if rank == 0 else None]
    dist.broadcast_object_list(work_list, src=0)
    work = Path(work_list[0])
    interrupted = False
    try:
        start = build_vae_and_latents(args, work) if rank == 0 else None
        dist.barrier()
        data = torch.load(work / "latents.pt")
        engine = DiffusersRolloutEngine(work / "pipeline", max_batch_size=64)
        engine.progress = False
        history: list[dict] = []
        try:
            step, ocr = pretrain_transformer(args, groups, engine, data, work, history, started)
        except KeyboardInterrupt:
            if rank != 0 or not history:
                raise
            # Ctrl-C keeps the model of the last evaluation, with its measured OCR similarity.
            interrupted = True
            step, ocr = history[-1]["step"], history[-1]["ocr"]
            print(f"\ninterrupted: writing the model of the last evaluation (step {step})")
        if rank == 0:
            record = {
                "command": "python " + " ".join(shlex.quote(a) for a in [sys.argv[0], *(argv or sys.argv[1:])]),
                "seed": args.seed, "tp": args.tp, "transformer_steps": step, "ocr_similarity": ocr,
                "interrupted": interrupted, "stop_ocr": args.stop_ocr,
                "eval": {"steps": args.eval_steps, "guidance": args.guidance,
                         "prompts": [prompt_for(w) for w in VOCABULARY]},
                "vae_mse": data["vae_mse"], "wall_minutes": round((time.time() - started) / 60, 2),
                "history": history, "args": vars(args), **start,
            }
            write_pipeline(engine, out, work, record)
            print(f"wrote {out}: {step} transformer steps, OCR similarity {ocr:.3f}, {record['wall_minutes']} min")
        if not interrupted:
            dist.barrier()
    finally:
        if rank == 0:
            shutil.rmtree(work, ignore_errors=True)
        platform.destroy_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
