"""hbp in the training loops people use, with the real packages (CPU, tiny configs, a few
steps): transformers' Trainer with its default arguments, Accelerate, PEFT LoRA, gradient
accumulation, bf16 autocast, and an eval / generate call between steps. Each loop's losses and
gradients are the plain loop's; the allocator's peak keeps the budget."""

import copy
import warnings

import pytest
import torch

import hbp
from hbp.allocator import allocator_peak
from hbp.errors import ConfigError

VOCAB, BATCH, TOKENS = 128, 4, 32


def _quiet():
    import transformers

    transformers.utils.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", message=".*(loss_type|Memory block).*")
    return transformers


def tiny_gpt2():
    t = _quiet()
    torch.manual_seed(0)
    config = t.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=TOKENS,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
    )  # fmt: skip
    return t.GPT2LMHeadModel(config)


def tiny_llama():
    t = _quiet()
    torch.manual_seed(0)
    config = t.LlamaConfig(
        num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, use_cache=False,
    )  # fmt: skip
    return t.LlamaForCausalLM(config)


class Rows(torch.utils.data.Dataset):
    """Token rows with a column the model does not take (Trainer removes it)."""

    def __init__(self, n: int = 16):
        generator = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, VOCAB, (n, TOKENS), generator=generator)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i], "row": torch.tensor(i)}


def _batch():
    rows = Rows()
    return {"input_ids": rows.ids[:BATCH], "labels": rows.ids[:BATCH]}


def _step_peak(model, batch) -> int:
    model.zero_grad(set_to_none=True)
    return allocator_peak(lambda: model(**batch).loss.backward())[1]


def _train(model, out_dir, steps=3):
    t = _quiet()
    args = t.TrainingArguments(
        output_dir=str(out_dir), per_device_train_batch_size=BATCH, max_steps=steps,
        learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to="none",
        use_cpu=True, seed=0, dataloader_num_workers=0,
    )  # fmt: skip
    trainer = t.Trainer(model=model, args=args, train_dataset=Rows())
    trainer.train()
    return trainer, [row["loss"] for row in trainer.state.log_history if "loss" in row]


@pytest.mark.slow
@pytest.mark.parametrize("form", ["enable", "HCModule"])
def test_trainer_with_default_arguments(tmp_path, form):
    plain = tiny_gpt2()
    model = copy.deepcopy(plain)
    _, expected = _train(plain, tmp_path / "plain")
    runner = hbp.enable(model, budget="min") if form == "enable" else hbp.HCModule(model, "min")
    trainer, losses = _train(runner, tmp_path / "hbp")
    assert len(losses) == 3
    torch.testing.assert_close(losses, expected, rtol=1e-5, atol=1e-6)
    for a, b in zip(plain.parameters(), model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    engine = hbp.engine_of(model) if form == "enable" else runner
    assert engine.captured.granularity == "op"
    assert _step_peak(runner, _batch()) <= 1.05 * engine.plan.budget_bytes
    if form == "enable":
        trainer.save_model(str(tmp_path / "saved"))
    else:  # Trainer saves a wrapper as a bare state dict; the wrapper's own save_pretrained
        runner.save_pretrained(tmp_path / "saved")  # is the model's (config.json included)
    loaded = type(model).from_pretrained(tmp_path / "saved")
    for (name, a), b in zip(model.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), name


@pytest.mark.slow
def test_accelerate_with_gradient_accumulation_and_generate_between_steps():
    from accelerate import Accelerator

    _quiet()
    plain, model = tiny_llama(), tiny_llama()
    hbp.enable(model, budget="min")
    losses = {}
    for name, net in (("plain", plain), ("hbp", model)):
        accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
        optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
        net, optimizer = accelerator.prepare(net, optimizer)
        batch, losses[name] = _batch(), []
        for step in range(4):
            with accelerator.accumulate(net):
                loss = net(**batch).loss
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            losses[name].append(loss.item())
            if step == 1:  # evaluation between steps: the plain forward, no plan
                with torch.no_grad():
                    net.eval()
                    net.generate(batch["input_ids"][:, :4], max_new_tokens=2, do_sample=False)
                    net.train()
    torch.testing.assert_close(losses["hbp"], losses["plain"], rtol=1e-4, atol=1e-5)
    engine = hbp.engine_of(model)
    assert _step_peak(model, batch) <= 1.05 * engine.plan.budget_bytes


@pytest.mark.slow
def test_enabled_after_accelerates_bf16_prepare_trains_in_bf16():
    """hbp.enable after `accelerator.prepare` with mixed precision: the training steps run in
    the autocast accelerate put around the forward (NOTE [ A forward wrapped before enable ]),
    the plain prepared model's losses and parameters, not fp32's."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    _quiet()
    batch, losses, models = _batch(), {}, {}
    for name in ("fp32", "plain", "hbp"):
        AcceleratorState._reset_state(True)  # one precision per process otherwise
        accelerator = Accelerator(cpu=True, mixed_precision="no" if name == "fp32" else "bf16")
        net = tiny_llama()
        optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
        net, optimizer = accelerator.prepare(net, optimizer)
        if name == "hbp":
            hbp.enable(net, budget="min")
        losses[name], models[name] = [], net
        for _ in range(3):
            loss = net(**batch).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses[name].append(loss.item())
    AcceleratorState._reset_state(True)
    assert losses["hbp"] == losses["plain"] and losses["hbp"][1:] != losses["fp32"][1:]
    for a, b in zip(models["plain"].parameters(), models["hbp"].parameters()):
        assert torch.equal(a, b)
    assert hbp.engine_of(models["hbp"]).plan.predicted_recompute_flops > 0


@pytest.mark.slow
def test_bf16_autocast_step():
    plain = tiny_llama()
    model = hbp.enable(copy.deepcopy(plain), budget="min")
    batch = _batch()
    for net in (plain, model):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = net(**batch).loss
        loss.backward()
    for a, b in zip(plain.parameters(), model.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=2e-2, atol=1e-3)
    engine = hbp.engine_of(model)
    assert engine.captured.granularity == "op"
    with torch.autocast("cpu", dtype=torch.bfloat16):
        peak = _step_peak(model, batch)
    assert peak <= 1.05 * engine.plan.budget_bytes


@pytest.mark.slow
def test_peft_lora_below_the_librarys_own_checkpointing():
    from peft import LoraConfig, get_peft_model

    _quiet()
    batch = _batch()
    config = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    library = get_peft_model(tiny_llama(), config)
    library.gradient_checkpointing_enable({"use_reentrant": False})
    library.train()
    _step_peak(library, batch)
    library_peak = _step_peak(library, batch)
    model = get_peft_model(tiny_llama(), config)
    model.train()
    hbp.enable(model, budget=library_peak)
    model(**batch).loss.backward()
    peak = _step_peak(model, batch)
    engine = hbp.engine_of(model)
    assert engine.captured.granularity == "op"
    assert peak <= library_peak, (peak, library_peak)
    for name, p in model.named_parameters():
        assert (p.grad is not None) == ("lora_" in name), name
    for a, b in zip(library.parameters(), model.parameters()):
        if a.grad is not None:
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6)


WORLD = 2


def _rank_batch(rank: int) -> dict:
    ids = Rows().ids[rank * BATCH : (rank + 1) * BATCH]
    return {"input_ids": ids, "labels": ids}


def _distributed_worker(rank: int, port: int, out: str) -> None:
    """Each kind (DDP, FSDP2) in turn, plain then enabled, in one process group: the gradients
    of the first step and the allocator's peak of the third."""
    import os

    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        result = {}
        for kind in ("ddp", "fsdp2"):
            for variant in ("plain", "hbp"):
                model = tiny_gpt2()
                if variant == "hbp":
                    hbp.enable(model, budget="min")
                net = DistributedDataParallel(model) if kind == "ddp" else fully_shard(model)
                batch = _rank_batch(rank)
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    net(**batch).loss.backward()
                result[f"{kind}_{variant}_said"] = [
                    str(w.message) for w in caught if issubclass(w.category, hbp.BudgetWarning)
                ]
                result[f"{kind}_{variant}"] = [
                    p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad.clone()
                    for p in model.parameters()
                ]
                _step_peak(net, batch)  # the closed loop's step, then the measured one
                result[f"{kind}_{variant}_peak"] = _step_peak(net, batch)
        # NOTE [ Data-parallel wrappers ]: enabled on the DDP wrapper, its all-reduce still
        # runs from the second step on; layers sharded by fully_shard are refused
        ddp = DistributedDataParallel(tiny_gpt2())
        hbp.enable(ddp, budget="min")
        for _ in range(3):
            ddp.zero_grad(set_to_none=True)
            ddp(**_rank_batch(rank)).loss.backward()
        result["ddp_enabled_outside"] = [p.grad.clone() for p in ddp.module.parameters()]
        sharded = tiny_gpt2()
        hbp.enable(sharded, budget="min")
        for block in sharded.transformer.h:
            fully_shard(block)
        fully_shard(sharded)
        try:
            sharded(**_rank_batch(rank)).loss.backward()
            result["fsdp2_layers"] = "ran"
        except ConfigError as err:
            result["fsdp2_layers"] = str(err)
        torch.save(result, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def distributed_ranks(tmp_path_factory):
    """Both kinds from one spawn of the two ranks (each rank imports torch and transformers
    once for the two)."""
    import torch.multiprocessing as mp

    from hbp.bench.distributed import free_port

    out = tmp_path_factory.mktemp("ranks")
    mp.spawn(_distributed_worker, args=(free_port(), str(out)), nprocs=WORLD, join=True)
    return [torch.load(out / f"rank{r}.pt") for r in range(WORLD)]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["ddp", "fsdp2"])
def test_ddp_and_fsdp2_over_an_enabled_model(distributed_ranks, kind):
    ranks = distributed_ranks
    plain = tiny_gpt2()
    total = None
    for rank in range(WORLD):
        plain.zero_grad(set_to_none=True)
        plain(**_rank_batch(rank)).loss.backward()
        grads = [p.grad.clone() for p in plain.parameters()]
        total = grads if total is None else [t + g for t, g in zip(total, grads)]
    for got, expected in zip(ranks[0][f"{kind}_hbp"], total):
        torch.testing.assert_close(got, expected / WORLD, rtol=1e-4, atol=1e-6)
    for rank in ranks:  # the saving per rank (the wrapper's own buffers count in both)
        hc, plain_peak = rank[f"{kind}_hbp_peak"], rank[f"{kind}_plain_peak"]
        assert hc < 0.75 * plain_peak, (hc, plain_peak)
    if kind == "ddp":  # enabled on the wrapper: averaged at the third step too
        for rank in ranks:
            for got, expected in zip(rank["ddp_enabled_outside"], total):
                torch.testing.assert_close(got, expected / WORLD, rtol=1e-4, atol=1e-6)
    else:
        for rank in ranks:  # the gathered parameters outside the budget, said once
            said = rank["fsdp2_hbp_said"]
            assert len([m for m in said if "all-gathered around the step" in m]) == 1, said
            assert "sharded by fully_shard" in rank["fsdp2_layers"], rank["fsdp2_layers"]
            assert "call fully_shard on the root module only" in rank["fsdp2_layers"]


def test_a_model_called_twice_before_backward_is_told_the_budget_holds_per_call():
    """Two towers of a contrastive loss: both calls' activations are live together, which the
    per-call budget cannot see (NOTE [ Calls before the previous call's backward ]), also
    once the plan has settled; a loop that calls once per backward is not warned."""
    from torch import nn
    from torch.nn import functional as F

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.ReLU()) for _ in range(4)])
    plain, once, pooled = copy.deepcopy(model), copy.deepcopy(model), copy.deepcopy(model)
    x1, x2 = torch.randn(64, 64), torch.randn(64, 64)
    hbp.enable(model, budget="min")
    hbp.enable(once, budget="min")
    hbp.enable(pooled, budget="min")

    def pooled_calls(m):  # each tower's output dropped, its graph kept, before the next call
        a, b = m(x1).mean(1), m(x1 + 1).mean(1)
        F.mse_loss(a, b).backward()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            pooled_calls(pooled)
    said = [w for w in caught if "called again before the backward" in str(w.message)]
    assert len(said) == 1

    def one_call(m):
        F.mse_loss(m(x1), x2).backward()

    def two_calls(m):
        F.cross_entropy(m(x1) @ m(x1 + 1).t(), torch.arange(64)).backward()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            one_call(once)
    assert not [w for w in caught if "called again before the backward" in str(w.message)]
    assert hbp.engine_of(once).compiled.settled
    with warnings.catch_warnings(record=True) as caught:  # the pattern after settling
        warnings.simplefilter("always")
        two_calls(once)
        two_calls(once)
    said = [w for w in caught if "called again before the backward" in str(w.message)]
    assert len(said) == 1
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            two_calls(model)
    said = [w for w in caught if "called again before the backward" in str(w.message)]
    assert len(said) == 1 and "budget holds per call" in str(said[0].message)
    model.zero_grad(set_to_none=True)
    two_calls(model)
    two_calls(plain)
    for p, q in zip(model.parameters(), plain.parameters()):
        assert torch.equal(p.grad, q.grad)
