"""A packed forward's attention (normlab.nn.packed.FoldedAttention): all members in one call of torch's fused
kernel, the members folded into its batch, with each member's loss and gradient its model's alone."""

from collections import Counter
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch.func import vmap
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import tiny_config
from normlab.nn import sublayers
from normlab.nn.model import GPT
from normlab.nn.packed import FoldedAttention, PackedModel


class AttentionCalls(TorchDispatchMode):
    """The batch size of every attention kernel dispatched (forward and backward), by op."""

    def __init__(self):
        super().__init__()
        self.batches: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "scaled_dot_product" in func.name():
            self.batches[func.name(), args[0].shape[0]] += 1
        return func(*args, **(kwargs or {}))


def _loss(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def _pack_and_members(norm="layer", size=3):
    cfg = tiny_config(norm, "pre")
    cfg.model = replace(cfg.model, vocab_size=256)
    torch.manual_seed(0)
    members = [GPT(cfg) for _ in range(size)]
    return cfg, members


def _step(pack, x, y, precision=None):
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
        losses = pack.losses(_loss, x, y)
    losses.sum().backward()
    return losses.detach(), {name: p.grad for name, p in pack.params.items()}


def test_a_packs_attention_is_one_fused_call_per_layer_giving_each_members_loss_and_gradient(one_thread):
    cfg, members = _pack_and_members()
    pack = PackedModel(members)
    x, y = torch.randint(0, 256, (3, 4, 16)), torch.randint(0, 256, (3, 4, 16))
    with AttentionCalls() as calls:
        losses, grads = _step(pack, x, y)
    # one forward and one backward per layer, of batch M·B (vmap alone runs member by member on the CPU)
    assert set(calls.batches.values()) == {cfg.depth} and {b for _, b in calls.batches} == {3 * 4}
    assert len(calls.batches) == 2
    assert sublayers.causal_attention is not FoldedAttention.apply  # put back after the call
    for m, model in enumerate(members):
        alone = _loss(model(x[m]), y[m])
        alone.backward()
        torch.testing.assert_close(losses[m], alone.detach(), rtol=1e-5, atol=0)
        for name, p in model.named_parameters():
            torch.testing.assert_close(grads[name][m], p.grad, rtol=1e-5, atol=1e-7, msg=name)


def test_under_bf16_autocast_folded_attention_gives_what_attention_under_vmap_gives(one_thread):
    """Both packed paths in bf16 on the CPU: the same losses, and gradients within bf16's rounding (measured:
    5e-3 of a tensor's largest value apart, the same as either path from the unpacked models)."""
    _, members = _pack_and_members()
    x = torch.randint(0, 256, (3, 4, 16))
    folded_losses, folded = _step(PackedModel(members), x, x, "bf16")
    vmapped_losses, vmapped = _step(PackedModel(members, fold_attention=False), x, x, "bf16")
    assert folded_losses.dtype == torch.bfloat16
    torch.testing.assert_close(folded_losses, vmapped_losses, rtol=0, atol=0)
    for name, grad in vmapped.items():
        assert folded[name].dtype == grad.dtype == torch.float32
        assert (folded[name] - grad).abs().max() <= 2e-2 * grad.abs().max(), name


def test_folded_attention_is_torchs_attention_alone_and_with_an_input_shared_by_the_members():
    torch.manual_seed(0)
    q, k, v = (torch.randn(3, 2, 2, 8, 4, requires_grad=True) for _ in range(3))
    shared = torch.randn(2, 2, 8, 4, requires_grad=True)

    def reference(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    for fn in (FoldedAttention.apply, reference):  # outside vmap: the function's own backward
        torch.testing.assert_close(fn(q[0], k[0], v[0]), reference(q[0], k[0], v[0]), rtol=0, atol=0)
    got = torch.autograd.grad(FoldedAttention.apply(q[0], k[0], v[0]).sin().sum(), (q, k, v))
    want = torch.autograd.grad(reference(q[0], k[0], v[0]).sin().sum(), (q, k, v))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    # under vmap, keys shared by every member (in_dims None): each member's attention over the same keys
    out = vmap(FoldedAttention.apply, in_dims=(0, None, 0))(q, shared, v)
    want = torch.stack([reference(q[m], shared, v[m]) for m in range(3)])
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-7)
    got = torch.autograd.grad(out.sin().sum(), (q, shared, v))
    want = torch.autograd.grad(want.sin().sum(), (q, shared, v))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)



def test_under_bf16_autocast_a_members_layers_compute_in_its_unpacked_runs_dtype():
    """Under vmap a Linear decomposes into a matmul (autocast casts it) and an add of its float32 bias, which
    promoted a member's layer outputs to float32, where its unpacked run's stay bf16: the pack casts the biases."""
    from normlab.train.loop import loss_fn

    cfg, members = _pack_and_members()
    assert members[0].blocks[0].mlp.fc.bias is not None
    seen = {}

    def record(name):
        def hook(module, inputs, output):
            seen.setdefault(name, output.dtype)
        return hook

    x = torch.randint(0, 256, (3, 2, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        handles = [members[0].blocks[0].mlp.fc.register_forward_hook(record("alone")),
                   members[0].blocks[1].attn.proj.register_forward_hook(record("alone proj"))]
        alone = loss_fn(members[0](x[0]), x[0])
        for h in handles:
            h.remove()
        pack = PackedModel(members)
        pack.template.blocks[0].mlp.fc.register_forward_hook(record("packed"))
        pack.template.blocks[1].attn.proj.register_forward_hook(record("packed proj"))
        losses = pack.losses(loss_fn, x, x)
    assert seen == {"alone": torch.bfloat16, "alone proj": torch.bfloat16,
                    "packed": torch.bfloat16, "packed proj": torch.bfloat16}
    torch.testing.assert_close(losses[0], alone, rtol=1e-2, atol=0)
    losses.sum().backward()
    assert pack.params["blocks.0.mlp.fc.bias"].grad.dtype == torch.float32
    assert pack.params["blocks.0.mlp.fc.bias"].grad.abs().sum() > 0
