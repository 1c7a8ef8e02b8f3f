"""Shared by the so.autoparallel tests (test_autoparallel*.py): the models no library ships (a ResNet-style CNN,
an nn.TransformerEncoder language model, transformers' tiny Llama and Mixtral), single-device references,
the applied plan's step on the threads world (bytes on every rank, loss, gradients) and the hand plans
(docs/parallel.md's for shardops' LLaMA/GPT-2, transformers' own for its models) it is compared with."""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
import torch.nn.functional as F

import shardops as so
from parallel_harness import count_step, strict
from shardops.autoparallel import language_model_loss
from shardops.fsdp import replicate
from shardops.parallel import from_transformers, loss_parallel, parallelize_module
from shardops.parallel.loss import target_placements


def token_batch(batch: int, seq: int, vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(0))


def reference(model, tokens):
    model = copy.deepcopy(model)
    loss = language_model_loss(model(tokens), tokens)
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def auto_step(plan, make, tokens):
    def main():
        model = plan.apply(make())
        local = plan.local_batch(tokens)  # this rank's batch slice
        with strict():
            return count_step(model, local, lambda out: language_model_loss(out, local))

    return so.run(main, plan.mesh_shape[0] * (plan.mesh_shape[1] if len(plan.mesh_shape) > 1 else 1))


def hand_step(make, hand_plan, mesh_shape, tokens):
    """The hand plan as docs/parallel.md applies it: tp on the last dim, torch's `replicate` (DDP) on the
    first, each dp rank on its batch slice."""

    def main():
        model = make()
        if len(mesh_shape) == 1:
            mesh = so.init_device_mesh("cpu", mesh_shape, mesh_dim_names=("tp",))
            parallelize_module(model, mesh, hand_plan())
            feed = tokens
        else:
            mesh = so.init_device_mesh("cpu", mesh_shape, mesh_dim_names=("dp", "tp"))
            parallelize_module(model, mesh["tp"], hand_plan())
            replicate(model, device_mesh=mesh["dp"])
            feed = tokens.chunk(mesh_shape[0])[mesh.get_coordinate()[0]]

        def loss_of(out):
            logits, target = out[:, :-1].flatten(0, 1), feed[:, 1:].flatten()
            if isinstance(logits, so.DTensor):  # this rank's batch shard, laid out like the logits, said explicitly
                target = so.from_local(target, logits.device_mesh, target_placements(logits.placements, 1))
            with loss_parallel():
                return F.cross_entropy(logits, target)

        with strict():
            return count_step(model, feed, loss_of)

    return so.run(main, mesh_shape[0] * (mesh_shape[1] if len(mesh_shape) > 1 else 1))


def check_values(results, ref_loss, ref_grads):
    """Each rank's loss is its batch slice's mean: the ranks' mean is the single-device loss (tensor-parallel
    ranks of one slice alike); every gradient (averaged over the data-parallel ranks) the single-device one."""
    torch.testing.assert_close(torch.stack([loss for _, loss, _ in results]).mean(), ref_loss, rtol=1e-4, atol=1e-5)
    for _, _, grads in results:
        assert grads.keys() == ref_grads.keys()
        for name, g in grads.items():
            torch.testing.assert_close(g, ref_grads[name], rtol=1e-3, atol=1e-5, msg=name)


def same_pricing_from_metadata(plan, model, mesh_shape, example, *, activations: bool = True, **kwargs):
    """Every candidate priced from metadata alone (one dry rank on META tensors) moves exactly the
    bytes and rounds, per step part, that the threads world measured on every rank, and needs the same
    memory; `activations=False`: the same memory but for the activations (experts on META tensors run as
    shapes only: docs/autoparallel.md)."""
    assert plan.pricing.startswith("measured")
    dry = so.autoparallel(model, mesh_shape, example, pricing="metadata", **kwargs)
    assert dry.pricing.startswith("from metadata")
    assert [s.candidate for s in dry.considered] == [s.candidate for s in plan.considered]
    for run_, meta in zip(plan.considered, dry.considered):
        a, b = run_.measurement, meta.measurement
        assert (a.error is None) == (b.error is None), (run_.candidate, a.error, b.error)
        if a.error is None:
            kept = (0, 0) if activations else (a.activation_bytes, b.activation_bytes)
            assert (a.bytes_per_part, a.rounds_per_part, a.memory_per_rank - kept[0]) == (
                b.bytes_per_part,
                b.rounds_per_part,
                b.memory_per_rank - kept[1],
            ), run_.candidate
    assert dry.candidate == plan.candidate and dry.predicted_bytes == plan.predicted_bytes
    return dry


def trains_exactly(plan, net, x, loss_fn):
    """The applied plan in strict mode: single-device loss and gradients (computed here), and the
    bytes it sends on every rank are its prediction."""
    ref = copy.deepcopy(net)
    ref_loss = loss_fn(ref(x), x)
    ref_loss.backward()

    def main():
        model = plan.apply(copy.deepcopy(net))
        local = plan.local_batch(x)  # this rank's batch slice
        with strict():
            return count_step(model, local, lambda out: loss_fn(out, local))

    results = so.run(main, math.prod(plan.mesh_shape))
    mean_loss = torch.stack([loss for _, loss, _ in results]).mean()  # each rank's is its slice's mean
    torch.testing.assert_close(mean_loss, ref_loss.detach(), rtol=1e-4, atol=1e-6)
    for _, _, grads in results:
        for name, p in ref.named_parameters():
            torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-6, msg=name)
    assert max(sent for sent, _, _ in results) == plan.predicted_bytes
    return results


def regression_loss(n_out: int):
    """A squared error against a per-sample target made from the sample itself, so a rank's batch slice
    carries its own targets (the loss as torch users compute it, on the local batch)."""

    def loss_fn(out, x):
        target = x.flatten(1)[:, :n_out].sin()
        return ((out - target) ** 2).mean()

    return loss_fn


def mlp_stack() -> torch.nn.Sequential:
    """Linear/ReLU/GELU, 16 -> 64 -> 16 -> 64 -> 4: two chained Linear pairs and no names to go by."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(16, 64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, 16),
        torch.nn.ReLU(),
        torch.nn.Linear(16, 64),
        torch.nn.GELU(),
        torch.nn.Linear(64, 4),
    )


class ResidualBlock(torch.nn.Module):
    """conv -> norm -> relu -> conv -> norm, added to the block's input (ResNet's basic block)."""

    def __init__(self, channels: int, norm):
        super().__init__()
        self.conv1, self.norm1 = torch.nn.Conv2d(channels, channels, 3, padding=1), norm(channels)
        self.conv2, self.norm2 = torch.nn.Conv2d(channels, channels, 3, padding=1), norm(channels)

    def forward(self, x):
        return torch.relu(x + self.norm2(self.conv2(torch.relu(self.norm1(self.conv1(x))))))


class SmallResNet(torch.nn.Module):
    """A stem conv, max pooling, one residual block, then global average pooling and a Linear head."""

    def __init__(self, norm=lambda c: torch.nn.GroupNorm(2, c)):
        super().__init__()
        torch.manual_seed(0)
        self.stem = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.pool = torch.nn.MaxPool2d(2)
        self.block = ResidualBlock(8, norm)
        self.head = torch.nn.Sequential(torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(8, 4))

    def forward(self, x):
        return self.head(self.block(self.pool(torch.relu(self.stem(x)))))


class EncoderModel(torch.nn.Module):
    """Tokens -> nn.TransformerEncoder (nn.MultiheadAttention inside) -> a vocabulary head."""

    def __init__(self, dim: int = 16, vocab: int = 32, ff: int = 32):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(vocab, dim)
        layer = torch.nn.TransformerEncoderLayer(dim, 2, ff, dropout=0.0, batch_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, tokens):
        return self.head(self.encoder(self.emb(tokens)))


# ------------------------------------------------------------------ transformers' models (a dev dependency)

TINY: dict[str, Any] = dict(
    vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=8, head_dim=4
)


def build_llama(kv_heads: int) -> torch.nn.Module:
    """transformers' LlamaForCausalLM from a tiny LlamaConfig, nothing downloaded."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(**TINY, num_key_value_heads=kv_heads)
    config._attn_implementation = "eager"
    return transformers.AutoModelForCausalLM.from_config(config).float()


def build_mixtral(kv_heads: int = 4) -> torch.nn.Module:
    """Mixtral with 4 experts (2 per token) in each of its 2 blocks; stacked expert weights (transformers 5.x)."""
    import transformers

    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        **TINY, num_key_value_heads=kv_heads, num_local_experts=4, num_experts_per_tok=2
    )
    config._attn_implementation = "eager"
    return transformers.AutoModelForCausalLM.from_config(config).float()


def check_transformers_values(results, model, tokens, local_loss=False):
    """Loss and every gradient equal single-device torch's. `local_loss`: each rank's loss is its dp
    batch slice's mean (torch's data parallelism), so their mean is the global loss."""
    ref = copy.deepcopy(model)
    ref_loss = language_model_loss(ref(tokens), tokens)
    ref_loss.backward()
    if local_loss:
        mean = torch.stack([loss for _, loss, _ in results]).mean()
        torch.testing.assert_close(mean, ref_loss.detach(), rtol=1e-4, atol=1e-5)
    for _, loss, grads in results:
        if not local_loss:
            torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-4, atol=1e-5)
        for name, p in ref.named_parameters():
            torch.testing.assert_close(grads[name], p.grad, rtol=1e-3, atol=1e-5, msg=name)


def transformers_hand_step(make, mesh_shape, tokens, expert_parallel: bool = False):
    """transformers' own plan as its users apply it through shardops: tp on the last dim, dp on the first
    (`expert_parallel`: the model's expert-parallel plan for its experts, on a 1-d mesh)."""

    def main():
        model = make()
        if len(mesh_shape) == 1:
            mesh = so.init_device_mesh("cpu", mesh_shape, mesh_dim_names=("tp",))
            from_transformers(model, mesh, expert_parallel=expert_parallel)
            feed = tokens
        else:
            mesh = so.init_device_mesh("cpu", mesh_shape, mesh_dim_names=("dp", "tp"))
            from_transformers(model, mesh["tp"])
            replicate(model, device_mesh=mesh["dp"])
            feed = tokens.chunk(mesh_shape[0])[mesh.get_coordinate()[0]]

        def loss_of(out):
            with loss_parallel():
                return F.cross_entropy(out.logits[:, :-1].flatten(0, 1), feed[:, 1:].flatten())

        with strict():
            return count_step(model, feed, loss_of)

    return so.run(main, math.prod(mesh_shape), timeout=600)
