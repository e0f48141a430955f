"""Real Megatron-Core 0.16.1 on CPU with gloo and explicit process groups, checked against single-rank math.

- ColumnParallelLinear -> RowParallelLinear at TP=2 equals the dense computation (output, weight grads);
- Megatron-Core's 1F1B schedule at PP=2 with 4 micro-batches on a stack of transformer layers equals the
  single-rank result (loss and every gradient);
- a distributed checkpoint saved at TP=2 loads at TP=1 with identical tensors.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
from megatron.core.pipeline_parallel.schedules import forward_backward_pipelining_without_interleaving
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.enums import ModelType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_omni.parallel import ParallelLayout, build_parallel_groups
from megatron_omni.parallel.platform import megatron_config_defaults, seed_everything
from megatron_omni.parallel.rank_pool import run_ranks


def _config(**overrides) -> TransformerConfig:
    kwargs = dict(
        num_layers=4, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
        hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.float32, pipeline_dtype=torch.float32,
        normalization="LayerNorm", add_bias_linear=True,
    )
    kwargs.update(megatron_config_defaults())
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


# ------------------------------------------------------------------------------ column -> row at TP=2


def _column_row(rank: int, world_size: int) -> dict[str, float]:
    groups = build_parallel_groups(ParallelLayout(tp=2))
    tp = groups.tp
    cfg = _config(tensor_model_parallel_size=2)
    torch.manual_seed(0)
    w1, b1 = torch.randn(64, 32), torch.randn(64)
    w2, b2 = torch.randn(32, 64), torch.randn(32)
    x = torch.randn(5, 3, 32)

    init = torch.nn.init.zeros_
    col = ColumnParallelLinear(32, 64, config=cfg, init_method=init, bias=True, gather_output=False,
                               tp_group=tp)
    row = RowParallelLinear(64, 32, config=cfg, init_method=init, bias=True, input_is_parallel=True,
                            skip_bias_add=False, tp_group=tp)
    t = tp.rank()
    with torch.no_grad():
        col.weight.copy_(w1.chunk(2, 0)[t])
        col.bias.copy_(b1.chunk(2, 0)[t])
        row.weight.copy_(w2.chunk(2, 1)[t])
        row.bias.copy_(b2)
    h, _ = col(x)
    y, _ = row(torch.nn.functional.gelu(h))
    y.square().sum().backward()

    # Dense reference with autograd.
    rw1, rb1, rw2, rb2 = (p.clone().requires_grad_() for p in (w1, b1, w2, b2))
    ry = torch.nn.functional.gelu(x @ rw1.T + rb1) @ rw2.T + rb2
    ry.square().sum().backward()
    return {
        "out": _rel(y, ry),
        "grad_w1": _rel(col.weight.grad, rw1.grad.chunk(2, 0)[t]),
        "grad_b1": _rel(col.bias.grad, rb1.grad.chunk(2, 0)[t]),
        "grad_w2": _rel(row.weight.grad, rw2.grad.chunk(2, 1)[t]),
        "grad_b2": _rel(row.bias.grad, rb2.grad),
    }


def test_column_row_parallel_tp2_equals_dense() -> None:
    for errors in run_ranks(_column_row, 2):
        for name, err in errors.items():
            assert err < 1e-5, (name, err)


# ---------------------------------------------------------------------------------- PP=2 schedule


class _Stack(MegatronModule):
    """A stack of Megatron-Core transformer layers that the pipeline schedules can drive."""

    def __init__(self, config: TransformerConfig, pg_collection, pre_process: bool, post_process: bool):
        super().__init__(config)
        self.model_type = ModelType.encoder_or_decoder
        self.pre_process = pre_process
        self.block = TransformerBlock(
            config, get_gpt_layer_local_spec(), post_layer_norm=post_process, pre_process=pre_process,
            post_process=post_process, pg_collection=pg_collection,
        )
        self.input_tensor = None

    def set_input_tensor(self, input_tensor) -> None:
        if isinstance(input_tensor, list):
            input_tensor = input_tensor[0]
        self.input_tensor = input_tensor
        self.block.set_input_tensor(input_tensor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x if self.pre_process else None, attention_mask=None)


def _pp_schedule(rank: int, world_size: int) -> dict:
    seq, mbs, hidden, n_mb = 6, 2, 32, 4
    torch.manual_seed(1)
    data = [torch.randn(seq, mbs, hidden) for _ in range(n_mb)]

    # Single-rank reference: all 4 layers on every rank (tp = pp = 1, dp = 2).
    ref_groups = build_parallel_groups(ParallelLayout())
    seed_everything(0)
    torch.manual_seed(2)
    ref = _Stack(_config(), ref_groups.mcore, True, True)
    total = 0.0
    for x in data:
        loss = ref(x).square().mean() / n_mb
        loss.backward()
        total += float(loss)
    ref_state = {k: v.detach().clone() for k, v in ref.state_dict().items() if torch.is_tensor(v)}
    ref_grads = {n: p.grad.clone() for n, p in ref.named_parameters()}

    groups = build_parallel_groups(ParallelLayout(pp=2))
    stage = groups.coords["pp"]
    cfg = _config(pipeline_model_parallel_size=2, batch_p2p_comm=False)
    model = _Stack(cfg, groups.mcore, groups.is_first_stage, groups.is_last_stage)
    # Copy the reference weights of this stage's layers (Megatron numbers layers globally, 1-based).
    own = model.state_dict()
    with torch.no_grad():
        for name, tensor in own.items():
            if name.startswith("block.layers."):
                idx = int(name.split(".")[2])
                ref_name = name.replace(f"layers.{idx}.", f"layers.{idx + 2 * stage}.", 1)
            else:
                ref_name = name
            if torch.is_tensor(tensor):
                tensor.copy_(ref_state[ref_name])

    def forward_step(data_iterator, module):
        x = next(data_iterator)
        out = module(x)

        def loss_func(output):
            loss = output.square().mean()
            return loss, {"loss": loss.detach().clone()}  # the schedule scales `loss` in place

        return out, loss_func

    p2p = P2PCommunicator(pp_group=groups.pp, config=cfg)
    losses = forward_backward_pipelining_without_interleaving(
        forward_step_func=forward_step, data_iterator=iter(data), model=[model], num_microbatches=n_mb,
        seq_length=seq, micro_batch_size=mbs, forward_only=False, p2p_communicator=p2p,
        pg_collection=groups.mcore,
    )
    errors = {}
    for name, p in model.named_parameters():
        if name.startswith("block.layers."):
            idx = int(name.split(".")[2])
            ref_name = name.replace(f"layers.{idx}.", f"layers.{idx + 2 * stage}.", 1)
        else:
            ref_name = name
        errors[ref_name] = _rel(p.grad, ref_grads[ref_name])
    pp_loss = sum(float(d["loss"]) for d in losses) / n_mb if groups.is_last_stage else None
    return {"errors": errors, "loss": pp_loss, "ref_loss": total}


def test_pipeline_schedule_pp2_equals_single_rank() -> None:
    results = run_ranks(_pp_schedule, 2)
    covered = set()
    for res in results:
        for name, err in res["errors"].items():
            assert err < 1e-5, (name, err)
            covered.add(name)
    # Every parameter of all four layers got a gradient on some stage.
    assert {n.split(".")[2] for n in covered if n.startswith("block.layers.")} == {"0", "1", "2", "3"}
    last = results[-1]
    assert abs(last["loss"] - last["ref_loss"]) < 1e-6 * abs(last["ref_loss"]) + 1e-9


# ------------------------------------------------------------------------- dist checkpoint TP2 -> TP1


def _save_tp2_load_tp1(rank: int, world_size: int, ckpt_dir: str) -> dict[str, float]:
    tp2 = build_parallel_groups(ParallelLayout(tp=2))
    torch.manual_seed(3)
    full = {n: torch.randn(64, 32) if n.endswith("weight") else torch.randn(64) for n in ("col.weight",
                                                                                         "col.bias")}
    full["row.weight"] = torch.randn(32, 64)
    cfg = _config(tensor_model_parallel_size=2)

    def build(tp_group, config):
        init = torch.nn.init.zeros_
        mod = torch.nn.Module()
        mod.col = ColumnParallelLinear(32, 64, config=config, init_method=init, bias=True, gather_output=False,
                                       tp_group=tp_group)
        mod.row = RowParallelLinear(64, 32, config=config, init_method=init, bias=False, input_is_parallel=True,
                                    skip_bias_add=False, tp_group=tp_group)
        return mod

    src = build(tp2.tp, cfg)
    t = tp2.tp.rank()
    with torch.no_grad():
        src.col.weight.copy_(full["col.weight"].chunk(2, 0)[t])
        src.col.bias.copy_(full["col.bias"].chunk(2, 0)[t])
        src.row.weight.copy_(full["row.weight"].chunk(2, 1)[t])

    def sharded(mod, groups):
        sd = {}
        for name in ("col", "row"):
            sd.update(getattr(mod, name).sharded_state_dict(
                prefix=f"{name}.", metadata={"dp_cp_group": groups.mcore.dp_cp}))
        return sd

    if rank == 0:
        os.makedirs(ckpt_dir)
    dist.barrier()
    dist_checkpointing.save(sharded(src, tp2), ckpt_dir)
    dist.barrier()

    tp1 = build_parallel_groups(ParallelLayout(tp=1))  # dp = 2: each rank loads the whole model
    dst = build(tp1.tp, _config(tensor_model_parallel_size=1))
    loaded = dist_checkpointing.load(sharded(dst, tp1), ckpt_dir)
    errors = {}
    for name in ("col.weight", "col.bias", "row.weight"):
        errors[name] = float((loaded[name] - full[name]).abs().max())
    return errors


def test_dist_checkpoint_tp2_loads_at_tp1(tmp_path) -> None:
    for errors in run_ranks(_save_tp2_load_tp1, 2, str(tmp_path / "ckpt")):
        for name, err in errors.items():
            assert err == 0.0, (name, err)
