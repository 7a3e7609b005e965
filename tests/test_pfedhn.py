"""pFedHN's hypernetwork (models/hypernet.py) and its update (algorithms/pfedhn.py), and
PLGU-GHN's LWSAM on it: gradients against autograd, target selection, size refusal."""

from __future__ import annotations

import pytest
import torch

from conftest import make_algo
from fedbench.errors import ConfigError
from fedbench.models import build_model
from fedbench.models.hypernet import HyperNetwork, hypernet_size, select_targets

pytestmark = pytest.mark.quick


def make(algo: str = "pfedhn", extra=()):
    return make_algo(algo, extra, lr=None)[0]


def test_vjp_is_the_gradient_of_theta_dot_delta():
    """g = (d theta_i / d phi)^T Delta == grad_phi sum(h(v_i; phi) * Delta), entry by entry of
    the flat hypernetwork vector, against the plain nn.Module with its own parameters."""
    algo = make()
    i = 1
    gen = torch.Generator().manual_seed(1)  # drawn on the CPU: the same Delta on any device
    delta = torch.randn(int(algo.gen_mask.sum()), generator=gen).to(algo.device)
    g = algo.vjp(i, delta)
    hnet = algo.hnet  # the module whose layout phi follows; load phi into its parameters
    algo.hspec.load_into(hnet, algo.phi)
    hnet.zero_grad()
    (hnet(torch.tensor([i], device=algo.device)) * delta).sum().backward()
    expect = torch.cat([p.grad.reshape(-1) for p in hnet.parameters()])
    torch.testing.assert_close(g, expect)
    emb = algo.hspec.index["embeddings.weight"]
    rows = g[emb.start : emb.stop].view(algo.N, -1).abs().sum(1)
    assert rows[i] > 0 and rows.sum() == rows[i]  # only v_i gets a gradient


def test_generated_state_is_the_hypernetwork_output():
    algo = make()
    s = algo.personal_state(2)
    P = algo.engine.n_params
    torch.testing.assert_close(s[:P], algo.generate(2).detach())  # generate=all: the whole model


def test_select_targets_partitions_the_model():
    model = build_model("mlp", (6,), 3, hidden=[8, 8])
    names = [n for n, _ in model.named_parameters()]
    t = select_targets(model, "all")
    assert list(t.generated) == names and not t.personal and not t.shared
    t = select_targets(model, "body")
    assert t.personal == ("head.weight", "head.bias") and not t.shared
    t = select_targets(model, "last_k", 2)
    assert t.generated == ("body.fc2.weight", "body.fc2.bias", "head.weight", "head.bias")
    assert t.shared == ("body.fc1.weight", "body.fc1.bias")
    with pytest.raises(ConfigError, match="hypernet.k"):
        select_targets(model, "last_k", 4)


def test_round_updates_phi_by_clipped_momentum_sgd_of_the_vjp():
    """One visit (server_update=sequential, one client): phi <- SGD(phi, clip(VJP(Delta)))."""
    algo = make(extra=["algo.inner_steps=3", "algo.hypernet.momentum=0.0"])
    phi0 = algo.phi.clone()
    with torch.no_grad():
        s0 = algo.state_of(0, algo.generate(0))
    _, delta, _ = algo.visit([0], 0, s0[None])  # the visit the round will repeat (same batches)
    g = algo.vjp(0, delta[0])
    algo.phi = phi0.clone()
    algo.round(0, [0])
    hn = algo.hp.hypernet
    g = g * min(1.0, hn.clip / (g.norm() + 1e-6))
    expect = phi0 - hn.lr * (g + hn.weight_decay * phi0)
    torch.testing.assert_close(algo.phi, expect)


def test_batched_generate_and_mean_vjp_are_the_per_client_ones():
    """`server_update: mean` maps the hypernetwork over the round's clients: its forward is
    each client's h(v_i; phi), its one VJP the mean of the clients' VJPs (linear in Delta)."""
    algo = make()
    clients = [2, 0, 1]
    theta = algo.generate_many(clients)
    torch.testing.assert_close(theta, torch.stack([algo.generate(i) for i in clients]))
    gen = torch.Generator().manual_seed(3)
    delta = torch.randn(len(clients), int(algo.gen_mask.sum()), generator=gen).to(algo.device)
    expect = torch.stack([algo.vjp(i, d) for i, d in zip(clients, delta)]).mean(0)
    torch.testing.assert_close(algo.mean_hypernet_grad(clients, delta), expect)


def test_mean_round_steps_phi_once_with_the_clients_mean_vjp():
    """server_update=mean: every client trains from the same phi (their visits batched) and
    phi takes one clipped SGD step with the mean of their VJPs."""
    algo = make(extra=["algo.inner_steps=3", "algo.hypernet.server_update=mean"])
    clients = [0, 1, 2]
    phi0 = algo.phi.clone()
    per_client = []
    for i in clients:  # each client's visit alone, from phi0
        with torch.no_grad():
            s0 = algo.state_of(i, algo.generate(i))
        per_client.append(algo.visit([i], 0, s0[None])[1][0])
    g = torch.stack([algo.vjp(i, d) for i, d in zip(clients, per_client)]).mean(0)
    algo.round(0, clients)
    hn = algo.hp.hypernet
    g = g * min(1.0, hn.clip / (g.norm() + 1e-6))
    expect = phi0 - hn.lr * (g + hn.weight_decay * phi0)  # momentum's first step: the gradient
    torch.testing.assert_close(algo.phi, expect)


def test_pfedhn_pc_keeps_heads_and_shares_nothing_else():
    algo = make(extra=["algo.hypernet.generate=body", "algo.inner_steps=2"])
    assert algo.inner_optim.lr == 5e-2  # pFedHN-PC's inner lr when inner_lr is null
    heads0 = algo.heads.clone()
    algo.round(0, [0, 2])
    assert not torch.equal(algo.heads[0], heads0[0]) and torch.equal(algo.heads[1], heads0[1])


def test_last_k_shares_and_averages_the_rest():
    algo = make(extra=["algo.hypernet.generate=last_k", "algo.hypernet.k=1", "algo.inner_steps=5"])
    P = algo.engine.n_params
    shared0 = algo.shared.clone()
    algo.round(0, [0, 1, 2])
    moved = algo.shared[:P] != shared0[:P]
    assert moved[algo.shared_entries[:P]].all() and not moved[algo.gen_mask].any()


def test_too_large_hypernetwork_is_refused_with_the_options():
    with pytest.raises(ConfigError, match=r"generate=last_k k=1: .*max_params"):
        make(extra=["algo.hypernet.max_params=1000"])


def test_resnet18_sizes_behind_the_preset_choice():
    """generate=all on ResNet-18 is ~1.1B parameters; the PLGU presets' last_k k=1 fits."""
    with torch.device("meta"):
        model = build_model("resnet18", (3, 32, 32), 10)
    numel = {n: p.numel() for n, p in model.named_parameters()}

    def size(gen, k=1):
        return hypernet_size(
            100, 26, 100, 3, [numel[n] for n in select_targets(model, gen, k).generated]
        )

    assert size("all") > 1e9
    assert size("last_k") < 50e6


def test_plgu_ghn_uniform_scores_is_sam_on_phi_only():
    """PLGU-GHN's update with `scores: uniform`: VJP at phi + rho g_phi / ||g_phi||, with the
    embeddings not perturbed; rho = 0 gives pFedHN's VJP."""
    algo = make("plgu_ghn", ["algo.scores=uniform", "algo.rho=0.5"])
    gen = torch.Generator().manual_seed(2)  # drawn on the CPU: the same Delta on any device
    delta = torch.randn(int(algo.gen_mask.sum()), generator=gen).to(algo.device)
    g = algo.vjp(0, delta)
    g_phi = g * ~algo.embed_entries
    eps = 0.5 * g_phi / (g_phi.norm() + 1e-12)
    torch.testing.assert_close(algo.hypernet_grad(0, delta), algo.vjp(0, delta, algo.phi + eps))
    flat = make("plgu_ghn", ["algo.rho=0.0"])
    torch.testing.assert_close(flat.hypernet_grad(0, delta), flat.vjp(0, delta))


def test_plgu_ghn_scales_each_head_by_its_layer_score():
    algo = make("plgu_ghn")
    assert algo.gen_layers.names == ["body.fc1", "head"]
    scale = algo.hn_scale(torch.tensor([1.5, 0.5], device=algo.device)).tolist()
    at = {e.name: lam for e, lam in zip(algo.hspec.params, scale)}
    assert at["heads.0.weight"] == at["heads.1.bias"] == 1.5  # generate body.fc1
    assert at["heads.2.weight"] == at["heads.3.bias"] == 0.5  # generate the head
    assert at["mlp.0.weight"] == at["mlp.6.bias"] == 1.0  # the trunk: the mean score
    assert at["embeddings.weight"] == 0.0  # v_i is not perturbed
    assert isinstance(algo.hnet, HyperNetwork)
