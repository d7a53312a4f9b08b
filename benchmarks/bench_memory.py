"""Per-rank memory of ddp vs zero1, zero2, zero3, fsdp and HSDP on the same model: `python -m benchmarks.bench_memory`.

Two gloo ranks on the CPU (or GPUs when present) each build the same GPT, take one AdamW step
with every strategy in turn, and count the bytes this rank holds for the model's weights (ZeRO-3:
its partitions; FSDP: its DTensor shards), its gradients at the end of the step, and the
optimizer state (Adam's exp_avg and exp_avg_sq). ZeRO-1 should hold
about 1/world_size of DDP's optimizer state, ZeRO-3 also about 1/world_size of the weights.
(ZeRO-2's gradient partitioning lives in DeepSpeed's internal buffers and is not counted here.)
Needs DeepSpeed for the zero rows. The `hsdp` row is fsdp with strategy.replicate=2 (2 replicas x
world/2 shards: run with --world-size 4 for a 2x2 mesh).

Beside each measured figure, `plan` is what `python -m ddptrain.plan` computes for the same model
and layout (ddptrain/train/memory_plan.py), and `act` the plan's activations of one microbatch beside the
bytes autograd saved on a real rank (saved-tensor hooks over the same forward).

With `--lora-r R` (default 8; 0: none) every strategy also gets a `+lora` row: peft's LoRA of rank R
on the same GPT's attention and MLP projections (what model.lora's `all-linear` adapts in a
transformers model), the base frozen, so the optimizer state and the gradients are the adapter's.
Needs peft for those rows.
"""

from __future__ import annotations

import argparse

import torch

STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "fsdp", "hsdp")
MICRO_BATCH_SIZE = 2


def _local(tensor):
    """This rank's part of a tensor: a DTensor's local shard (FSDP), a ZeRO-3 partition, or all of it."""
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        return tensor.to_local()
    return getattr(tensor, "ds_tensor", tensor)


def _tensor_bytes(tensors) -> int:
    return sum(_local(t).numel() * _local(t).element_size() for t in tensors if torch.is_tensor(t))


LORA_SUFFIX = "+lora"
GPT_LINEAR = ["qkv", "proj", "fc"]
"""The GPT's attention and MLP projections (not the head): the modules LoRA adapts here."""


def _lora(model, rank: int):
    """peft's LoRA of `rank` on the GPT's projections; every other parameter frozen."""
    import peft

    return peft.get_peft_model(model, peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=GPT_LINEAR))


def _measure(row: str, n_layer: int, n_embd: int, seq_len: int, lora_r: int) -> dict:
    import ddptrain
    from ddptrain.models import GPT, GPTConfig

    strategy = row.removesuffix(LORA_SUFFIX)
    replicate = 2 if strategy == "hsdp" else 1
    strategy = "fsdp" if strategy == "hsdp" else strategy
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, max_seq_len=seq_len, n_layer=n_layer, n_head=4, n_embd=n_embd))
    if row.endswith(LORA_SUFFIX):
        model = _lora(model, lora_r)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    options = {"micro_batch_size": MICRO_BATCH_SIZE, "grad_accum_steps": 1} if strategy.startswith("zero") else {}
    if strategy == "fsdp":
        options = {"replicate": replicate}
    engine = ddptrain.Engine(model, optimizer, strategy, strategy_options=options)
    module = getattr(engine.model, "module", engine.model)  # DDP and DeepSpeed wrap; FSDP2 shards in place
    gradients = []
    zero_grad = engine.strategy.zero_grad

    def count_then_zero():  # the gradients this rank holds when the step ends, before they are dropped
        gradients.append(_tensor_bytes(p.grad for p in module.parameters() if p.grad is not None))
        zero_grad()

    engine.strategy.zero_grad = count_then_zero
    gen = torch.Generator().manual_seed(ddptrain.get_rank())
    tokens = torch.randint(0, 256, (MICRO_BATCH_SIZE, seq_len + 1), generator=gen)
    saved = [0]

    def pack(tensor):  # what autograd keeps for backward, parameters left out (as the plan counts)
        if not isinstance(tensor if tensor._base is None else tensor._base, torch.nn.Parameter):
            saved[0] += tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        engine.step([(tokens[:, :-1], tokens[:, 1:])])  # Adam creates its state on the first step
    optimizer = engine.strategy.optimizer  # the torch AdamW (ZeRO hands it its flat partitions)
    state = _tensor_bytes(v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0)
    weights = _tensor_bytes(p for p in module.parameters())
    # DeepSpeed keeps gradient partitions in its own buffers and frees .grad in its step: not counted.
    grads = None if strategy.startswith("zero") else gradients[-1]
    counts = [(p.ds_numel if hasattr(p, "ds_numel") else _numel(p), p.requires_grad) for p in module.parameters()]
    return {"strategy": row, "rank": ddptrain.get_rank(), "optimizer_state": state, "weights": weights,
            "gradients": grads, "parameters": sum(n for n, _ in counts),
            "trainable": sum(n for n, trains in counts if trains), "activations": saved[0]}


def _numel(param) -> int:
    from torch.distributed.tensor import DTensor

    return param.full_tensor().numel() if isinstance(param, DTensor) else param.numel()


def _measure_all(rows: tuple[str, ...], n_layer: int, n_embd: int, seq_len: int, lora_r: int) -> list[dict]:
    return [_measure(name, n_layer, n_embd, seq_len, lora_r) for name in rows]


def _plan(row: str, args):
    """The plan's figures for this row's model and strategy (ddptrain/train/memory_plan.py), on the meta device."""
    from ddptrain.models import GPT, GPTConfig
    from ddptrain.engine.chunked import chunk_rows
    from ddptrain.train.memory_plan import Layout, count_model, meta_device, plan_strategies

    with meta_device():
        model = GPT(GPTConfig(vocab_size=256, max_seq_len=args.seq_len, n_layer=args.n_layer, n_head=4,
                              n_embd=args.n_embd))
        if row.endswith(LORA_SUFFIX):
            model = _lora(model, args.lora_r)
    strategy = row.removesuffix(LORA_SUFFIX)
    hsdp = strategy == "hsdp"
    layout = Layout(world_size=args.world_size, ranks_per_node=args.world_size // 2 if hsdp else args.world_size,
                    replicate=2 if hsdp else 1, micro_batch_size=MICRO_BATCH_SIZE, seq_len=args.seq_len,
                    grad_accum_steps=1, precision="fp32", optimizer="adamw")
    # the engine's default path, the chunked head, as the measured step runs it
    counts = count_model(model, {"Block"}, MICRO_BATCH_SIZE, args.seq_len, "fp32", 256,
                         head_chunk_tokens=chunk_rows(256))
    return next(plan for plan in plan_strategies(counts, layout) if plan.name == strategy)


def _mib(count: int) -> str:
    return f"{count / 2**20:9.2f}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=256)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--lora-r", type=int, default=8, help="rank of the +lora rows (0: no LoRA rows)")
    args = parser.parse_args(argv)

    from ddptrain.testing import run_distributed

    strategies = tuple(args.strategies.split(","))
    rows = strategies + (tuple(name + LORA_SUFFIX for name in strategies) if args.lora_r > 0 else ())
    results = run_distributed(_measure_all, args.world_size, rows, args.n_layer, args.n_embd, args.seq_len,
                              args.lora_r, timeout_s=900)
    plans = {row: _plan(row, args) for row in rows}
    print(f"GPT n_layer={args.n_layer} n_embd={args.n_embd}: {results[0][0]['parameters']:,} parameters (fp32), "
          f"AdamW, {args.world_size} ranks, micro {MICRO_BATCH_SIZE} x seq {args.seq_len}; MiB held per rank, "
          "measured | plan (python -m ddptrain.plan)")
    print(f"{'strategy':11} {'rank':>4} {'weights':>9} {'vs ddp':>7} {'plan':>9} {'grads':>9} {'vs ddp':>7} "
          f"{'plan':>9} {'opt state':>10} {'vs ddp':>7} {'plan':>9} {'act':>9} {'plan':>9}")
    ddp = {rank: rows_of_rank[0] for rank, rows_of_rank in enumerate(results)} if strategies[0] == "ddp" else None

    def ratio(row, rank, key):
        if not ddp or row[key] is None or not ddp[rank][key]:
            return "      -"
        return f"{row[key] / ddp[rank][key]:7.2f}"

    for rank, rows_of_rank in enumerate(results):
        for row in rows_of_rank:
            plan = plans[row["strategy"]]
            grads = _mib(row["gradients"]) if row["gradients"] is not None else "      n/a"
            print(f"{row['strategy']:11} {rank:>4} {_mib(row['weights'])} {ratio(row, rank, 'weights')} "
                  f"{_mib(plan.weights)} {grads} {ratio(row, rank, 'gradients')} {_mib(plan.gradients)} "
                  f"{_mib(row['optimizer_state']):>10} {ratio(row, rank, 'optimizer_state')} "
                  f"{_mib(plan.optimizer_state)} {_mib(row['activations'])} {_mib(plan.activations.bytes)}")
    print("n/a: DeepSpeed keeps gradient partitions in its internal buffers, not in .grad; hsdp: fsdp with "
          f"strategy.replicate=2 ({2} x {args.world_size // 2})")
    lora = next((row for row in results[0] if row["strategy"].endswith(LORA_SUFFIX)), None)
    if lora is not None:
        print(f"+lora: peft LoRA r={args.lora_r} on {', '.join(GPT_LINEAR)}; {lora['trainable']:,} of "
              f"{lora['parameters']:,} parameters train (vs ddp: against full fine-tuning with ddp)")


if __name__ == "__main__":
    main()
