"""Server optimizers (fedbench/algorithms/_server.py, `server_opt=`): each against its update
rule by hand, SGD at lr 1 equal to plain averaging to the bit, buffers averaged, state
checkpointed (resume exact), refused where the server does not average, and FedAvg with
FedAdam / FedAvgM learning on real FMNIST; `server_opt.variant=authors_code` against the
authors' optimizers (Keras's Adagrad and Adam, their yogi.py) written out in float64, its
state (with the step count) checkpointed, and configs saved before the key resuming."""

from __future__ import annotations

import io
import math

import numpy as np
import pytest
import torch

from conftest import make_algo, run_small
from fedbench.algorithms._server import ServerOptimizer, ServerOptSettings


def reference(name: str, xs: list[np.ndarray], avgs: list[np.ndarray], **hp) -> np.ndarray:
    """Reddi et al. Algorithm 2 / FedAvgM, written out in numpy (float64) for a sequence of
    rounds; x is the server's vector before the first round, avgs the clients' averages."""
    s = ServerOptSettings(name=name, **hp)
    x = xs[0].astype(np.float64)
    m = np.zeros_like(x)
    v = np.full_like(x, s.tau**2) if name != "sgd" else np.zeros_like(x)
    for avg in avgs:
        d = avg - x
        if name == "sgd":
            v = s.momentum * v + d
            x = x + s.lr * v
            continue
        m = s.beta1 * m + (1 - s.beta1) * d
        if name == "adagrad":
            v = v + d**2
        elif name == "adam":
            v = s.beta2 * v + (1 - s.beta2) * d**2
        else:
            v = v - (1 - s.beta2) * d**2 * np.sign(v - d**2)
        x = x + s.lr * m / (np.sqrt(v) + s.tau)
    return x


@pytest.mark.quick
@pytest.mark.parametrize(
    "name,hp",
    [
        ("sgd", {"lr": 0.7, "momentum": 0.9}),
        ("adagrad", {"lr": 0.1, "beta1": 0.9, "tau": 1e-2}),
        ("adam", {"lr": 0.1, "beta1": 0.9, "beta2": 0.99, "tau": 1e-3}),
        ("yogi", {"lr": 0.1, "beta1": 0.5, "beta2": 0.9, "tau": 1e-3}),
    ],
)
def test_each_optimizer_follows_its_update_rule(name, hp):
    rng = np.random.default_rng(0)
    x0 = rng.normal(size=7)
    avgs = [x0 + rng.normal(scale=0.3, size=7) * (k + 1) for k in range(4)]
    opt = ServerOptimizer(ServerOptSettings(name=name, **hp))
    x = torch.tensor(x0, dtype=torch.float64)
    for k, avg in enumerate(avgs):
        # the average as the clients would send it after this round (relative to the new x)
        a = torch.tensor(avg, dtype=torch.float64)
        x = opt.step("w", x, a, slice(0, 7))
        want = reference(name, [x0], avgs[: k + 1], **hp)
        np.testing.assert_allclose(x.numpy(), want, rtol=1e-12, atol=1e-12)


@pytest.mark.quick
def test_yogi_v_moves_by_the_sign_rule_and_adam_by_the_average():
    """One step from v = tau^2 by hand: Delta = 2, tau = 0.1, beta2 = 0.9."""
    x, avg = torch.zeros(1, dtype=torch.float64), torch.full((1,), 2.0, dtype=torch.float64)
    for name, v1 in (("yogi", 0.01 + 0.1 * 4.0), ("adam", 0.9 * 0.01 + 0.1 * 4.0)):
        opt = ServerOptimizer(ServerOptSettings(name=name, lr=1.0, beta1=0.0, beta2=0.9, tau=0.1))
        new = opt.step("w", x, avg, slice(0, 1))
        assert opt.state["w"]["v"].item() == pytest.approx(v1)
        assert new.item() == pytest.approx(2.0 / (v1**0.5 + 0.1))


@pytest.mark.quick
def test_buffers_take_the_average_and_none_is_the_average_itself():
    x, avg = torch.zeros(5), torch.arange(5.0)
    opt = ServerOptimizer(ServerOptSettings(name="adam", lr=0.5))
    new = opt.step("w", x, avg, slice(0, 3))  # entries 3, 4: buffers
    assert torch.equal(new[3:], avg[3:]) and not torch.equal(new[:3], avg[:3])
    assert ServerOptimizer(ServerOptSettings()).step("w", x, avg, slice(0, 3)) is avg


@pytest.mark.quick
@pytest.mark.parametrize("algo", ["fedavg", "fedper", "fedrep", "ditto", "perfedavg"])
def test_sgd_at_lr_one_is_plain_averaging_to_the_bit(algo):
    plain, _, _ = make_algo(algo)
    sgd, _, _ = make_algo(algo, ["server_opt=sgd", "server_opt.lr=1", "server_opt.momentum=0"])
    for t in range(3):
        clients = np.array([0, 2]) if t % 2 else np.array([0, 1, 2])
        plain.round(t, clients)
        sgd.round(t, clients)
    for key in plain.state_keys:
        a, b = getattr(plain, key), getattr(sgd, key)
        assert torch.equal(a, b), key


# the attribute holding the server's averaged model, where it is not `w`
SERVER_MODEL = {"fedper": "base", "fedbn": "base", "fedrep": "phi", "plgu_grep": "phi"}
SERVER_MODEL |= {"fedpac": "theta", "fedem": "components"}


def server_optimizable() -> list[str]:
    from fedbench.algorithms import ALGORITHMS

    return sorted(n for n in ALGORITHMS.names() if ALGORITHMS.get(n).server_optimizable)


@pytest.mark.quick
@pytest.mark.parametrize("algo", server_optimizable())
def test_each_server_steps_from_the_model_it_sent(algo):
    """x of `server_step` is the server's model before the round: at server SGD lr 1/2 the
    new model is lerp(old, the plain round's new model, 1/2) (entries the server keeps
    unchanged stay so); lr 1 (the test above) cannot tell a wrong x from the right one."""
    a, _, _ = make_algo(algo)
    key = SERVER_MODEL.get(algo, "w")
    saved = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in a.state_dict().items()}
    old = getattr(a, key).clone()
    clients = np.array([0, 1, 2])
    a.round(0, clients)
    plain = getattr(a, key).clone()
    assert not torch.equal(plain, old)
    a.load_state_dict(saved)  # the same round again, under server SGD at lr 1/2
    a.server_opt = ServerOptimizer(ServerOptSettings(name="sgd", lr=0.5))
    a.round(0, clients)
    torch.testing.assert_close(getattr(a, key), torch.lerp(old, plain, 0.5))


@pytest.mark.quick
def test_fedavg_with_fedadam_steps_from_its_average():
    """FedAvg's server under server_opt=adam: w^{t+1} = w^t + lr m / (sqrt(v) + tau), from
    the very average plain FedAvg computes on the same uploads."""
    adam, _, _ = make_algo("fedavg", ["server_opt=adam", "server_opt.lr=0.05"])
    plain, _, _ = make_algo("fedavg")
    w0 = adam.w.clone()
    assert torch.equal(w0, plain.w)
    clients = np.array([0, 1, 2])
    adam.round(0, clients)
    plain.round(0, clients)  # the same training from the same w: its w is the average
    P = adam.engine.n_params
    d = (plain.w - w0)[:P].double()
    s = adam.run.server_opt
    m = (1 - s.beta1) * d
    v = s.beta2 * s.tau**2 + (1 - s.beta2) * d**2
    want = w0[:P].double() + s.lr * m / (v.sqrt() + s.tau)
    torch.testing.assert_close(adam.w[:P].double(), want, rtol=1e-5, atol=1e-7)
    assert torch.equal(adam.w[P:], plain.w[P:])  # buffers (none in this MLP) averaged


@pytest.mark.quick
def test_server_state_is_checkpointed_and_a_resume_is_exact():
    over = ["server_opt=yogi", "server_opt.lr=0.05"]
    full, _, _ = make_algo("fedavg", over)
    cut, _, _ = make_algo("fedavg", over)
    clients = np.array([0, 1, 2])
    for t in range(2):
        full.round(t, clients)
        cut.round(t, clients)
    state = {
        k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in cut.state_dict().items()
    }
    assert set(state["server_opt"]["w"]) == {"m", "v"}
    resumed, _, _ = make_algo("fedavg", over)
    resumed.load_state_dict(state)
    for t in range(2, 4):
        full.round(t, clients)
        resumed.round(t, clients)
    assert torch.equal(full.w, resumed.w)


@pytest.mark.quick
def test_refused_where_the_server_does_not_average():
    from fedbench.cli import refusal

    msg = refusal(["algo=fedamp", "server_opt=adam"])
    assert msg.startswith("fedbench: server_opt=adam: algo=fedamp's server does not average")
    assert "fedavg" in msg and "\n" not in msg
    assert refusal(["algo=fedavg", "server_opt=yogi", "server_opt.beta2=1"]).startswith(
        "fedbench: server_opt.beta2=1"
    )
    assert refusal(["algo=fedavg", "server_opt=adam"]) is None


@pytest.mark.quick
def test_a_run_saved_before_server_opt_resumes():
    """A config saved without the server_opt node (an older fedbench) is not a difference
    from server_opt=none on resume."""
    from conftest import compose
    from fedbench.runner import resume_differences
    from fedbench.trees import plain

    now = plain(compose(["algo=fedavg"]))
    saved = {k: v for k, v in now.items() if k != "server_opt"}
    assert resume_differences(saved, now) == []
    assert resume_differences(saved, plain(compose(["algo=fedavg", "server_opt=adam"])))


@pytest.mark.slow
@pytest.mark.parametrize(
    "over,bar",
    [(["server_opt=adam", "server_opt.lr=0.01"], 0.65), (["server_opt=sgd"], 0.65)],
    ids=["fedadam", "fedavgm"],
)
def test_fedavg_learns_fmnist_with_a_server_optimizer(tmp_path, over, bar):
    """FedAvg's global model on the small FMNIST federation (pat-2, 20 clients, 10 rounds,
    local SGD lr 0.05): FedAdam at server lr 1e-2 and FedAvgM (lr 1, momentum 0.9) learn
    (seen: FedAdam 0.727, FedAvgM 0.752, plain FedAvg 0.725; chance 0.1)."""
    summary, _ = run_small(tmp_path, ["algo=fedavg", "optim.lr=0.05", *over], 10)
    assert summary["final"]["global"]["G"]["avg"] > bar


# ------------------------------------------------------- variant authors_code (RECONSTRUCTION)
def authors_reference(name: str, x0: np.ndarray, avgs: list[np.ndarray], **hp) -> np.ndarray:
    """The authors' server optimizers as their code runs them, in numpy (float64): TFF hands
    the optimizer g = -Delta (fed_avg_schedule.py: `-1.0 * weights_delta`), Keras's Adagrad
    (ResourceApplyAdagradV2: accum += g^2; var -= lr g / (sqrt(accum) + epsilon)), Keras's
    Adam (ResourceApplyAdam: m += (g - m)(1 - beta1); v += (g^2 - v)(1 - beta2); var -=
    lr sqrt(1 - beta2^t) / (1 - beta1^t) m / (sqrt(v) + epsilon)) and yogi.py (v += (1 -
    beta2) sign(g^2 - v) g^2, the same corrected step), with epsilon = tau, t = 1, 2, ...
    and the accumulator from `initial_accumulator` (0 if None)."""
    lr, tau = hp["lr"], hp["tau"]
    b1, b2 = hp.get("beta1", 0.0), hp.get("beta2", 0.0)
    var = x0.astype(np.float64).copy()
    m = np.zeros_like(var)
    accum = np.full_like(var, hp.get("initial_accumulator") or 0.0)
    for t, avg in enumerate(avgs, start=1):
        g = -(avg - var)
        if name == "adagrad":
            accum = accum + g * g
            var = var - lr * g / (np.sqrt(accum) + tau)
            continue
        m = m + (g - m) * (1 - b1)
        if name == "adam":
            accum = accum + (g * g - accum) * (1 - b2)
        else:
            accum = accum + (1 - b2) * np.sign(g * g - accum) * (g * g)
        alpha = lr * math.sqrt(1 - b2**t) / (1 - b1**t)
        var = var - alpha * m / (np.sqrt(accum) + tau)
    return var


AUTHORS_CASES = [
    ("adagrad", {"lr": 0.1, "beta1": 0.0, "tau": 1e-2}),
    ("adagrad", {"lr": 0.3, "beta1": 0.0, "tau": 1e-3, "initial_accumulator": 0.1}),
    ("adam", {"lr": 0.1, "beta1": 0.9, "beta2": 0.999, "tau": 1e-3}),
    ("adam", {"lr": 0.05, "beta1": 0.0, "beta2": 0.9, "tau": 1e-1}),
    ("yogi", {"lr": 0.1, "beta1": 0.9, "beta2": 0.999, "tau": 1e-3}),
    ("yogi", {"lr": 0.05, "beta1": 0.5, "beta2": 0.9, "tau": 1e-2, "initial_accumulator": 1.0}),
]


@pytest.mark.quick
@pytest.mark.parametrize("name,hp", AUTHORS_CASES)
def test_authors_code_variant_computes_the_authors_optimizers(name, hp):
    """Four rounds of `variant: authors_code` against the authors' optimizers' formulas
    (float64, 1e-12); the bias-corrected ones keep their step count t, Adagrad keeps no m;
    the result differs from `variant: paper` on the same settings (but for Adagrad from the
    same start, below)."""
    rng = np.random.default_rng(1)
    x0 = rng.normal(size=9)
    avgs = [x0 + rng.normal(scale=0.4, size=9) * (k + 1) for k in range(4)]
    opt = ServerOptimizer(ServerOptSettings(name=name, variant="authors_code", **hp))
    x = torch.tensor(x0, dtype=torch.float64)
    for k, avg in enumerate(avgs):
        x = opt.step("w", x, torch.tensor(avg, dtype=torch.float64), slice(0, 9))
        want = authors_reference(name, x0, avgs[: k + 1], **hp)
        np.testing.assert_allclose(x.numpy(), want, rtol=1e-12, atol=1e-12)
    st = opt.state["w"]
    assert set(st) == ({"v"} if name == "adagrad" else {"m", "v", "t"})
    if name != "adagrad":
        assert int(st["t"]) == 4
    paper = ServerOptimizer(ServerOptSettings(name=name, **hp))
    y = torch.tensor(x0, dtype=torch.float64)
    for avg in avgs:
        y = paper.step("w", y, torch.tensor(avg, dtype=torch.float64), slice(0, 9))
    if name == "adagrad" and hp.get("initial_accumulator") is not None:
        # Keras's Adagrad is Algorithm 2's FedAdagrad at beta1 0 from the same v: the
        # variants differ only in v's start (0, not tau^2) and in refusing beta1 > 0
        np.testing.assert_allclose(x.numpy(), y.numpy(), rtol=1e-12, atol=1e-12)
    else:
        assert not torch.allclose(x, y, rtol=1e-3, atol=0)  # the variants do differ


@pytest.mark.quick
@pytest.mark.parametrize("name", ["adam", "yogi"])
def test_authors_first_step_is_bias_corrected(name):
    """By hand: from m = v = 0 the first corrected step is lr_t m / (sqrt(v) + tau) with
    lr_t = lr sqrt(1 - beta2) / (1 - beta1), m = (1 - beta1) Delta, v = (1 - beta2) Delta^2,
    i.e. lr Delta / (|Delta| + tau / sqrt(1 - beta2)): nearly lr sign(Delta)."""
    lr, b1, b2, tau = 0.5, 0.9, 0.999, 1e-3
    s = ServerOptSettings(name=name, lr=lr, beta1=b1, beta2=b2, tau=tau, variant="authors_code")
    delta = torch.tensor([2.0, -0.01, 0.0], dtype=torch.float64)
    new = ServerOptimizer(s).step("w", torch.zeros(3, dtype=torch.float64), delta, slice(0, 3))
    want = lr * delta / (delta.abs() + tau / math.sqrt(1 - b2))
    np.testing.assert_allclose(new.numpy(), want.numpy(), rtol=1e-13, atol=1e-15)


@pytest.mark.quick
def test_variant_defaults_to_paper_and_only_the_adaptive_yamls_have_it():
    from conftest import compose
    from fedbench.trees import plain

    assert ServerOptSettings().variant == "paper"
    for name in ("adagrad", "adam", "yogi"):
        node = plain(compose(["algo=fedavg", f"server_opt={name}"]))["server_opt"]
        assert node["variant"] == "paper"
        assert node.get("initial_accumulator", None) is None
        assert ServerOptSettings.from_cfg(node).v0 == node["tau"] ** 2  # Algorithm 2's v_-1
    assert "variant" not in plain(compose(["algo=fedavg", "server_opt=sgd"]))["server_opt"]
    algo, _, _ = make_algo("fedavg", ["server_opt=yogi", "server_opt.variant=authors_code"])
    assert algo.run.server_opt.variant == "authors_code" and algo.run.server_opt.v0 == 0.0


@pytest.mark.quick
@pytest.mark.parametrize(
    "over",
    [
        ["server_opt=adam"],
        ["server_opt=yogi", "server_opt.initial_accumulator=1.0"],
        ["server_opt=adagrad", "server_opt.beta1=0"],
    ],
    ids=["adam", "yogi", "adagrad"],
)
def test_authors_code_state_is_checkpointed_and_a_resume_is_exact(over):
    """Two rounds, the state through torch.save/torch.load, two more rounds: the same model
    as four uninterrupted rounds, to the bit; the step count travels with m and v."""
    over = ["server_opt.variant=authors_code", "server_opt.lr=0.05", *over]
    full, _, _ = make_algo("fedavg", over)
    clients = np.array([0, 1, 2])
    for t in range(2):
        full.round(t, clients)
    buf = io.BytesIO()
    torch.save(full.state_dict(), buf)  # a copy: the rounds below do not touch it
    buf.seek(0)
    state = torch.load(buf, weights_only=False)
    saved = state["server_opt"]["w"]
    if "server_opt=adagrad" in over:
        assert set(saved) == {"v"}
    else:
        assert set(saved) == {"m", "v", "t"} and int(saved["t"]) == 2
    resumed, _, _ = make_algo("fedavg", over)
    resumed.load_state_dict(state)
    for t in range(2, 4):
        full.round(t, clients)
        resumed.round(t, clients)
    assert torch.equal(full.w, resumed.w)
    assert int(resumed.server_opt.state["w"].get("t", torch.tensor(4))) == 4


@pytest.mark.quick
def test_a_run_saved_before_the_variant_resumes_as_paper():
    """A config saved before `server_opt.variant` / `initial_accumulator` existed ran
    Algorithm 2 as printed: no difference from variant paper, a difference from
    authors_code."""
    from conftest import compose
    from fedbench.runner import resume_differences
    from fedbench.trees import plain

    for name in ("adagrad", "adam", "yogi"):
        now = plain(compose(["algo=fedavg", f"server_opt={name}"]))
        saved = {**now, "server_opt": dict(now["server_opt"])}
        saved["server_opt"].pop("variant")
        saved["server_opt"].pop("initial_accumulator", None)
        assert resume_differences(saved, now) == []
        code = {**now, "server_opt": {**now["server_opt"], "variant": "authors_code"}}
        assert resume_differences(saved, code) == ["server_opt.variant (absent -> 'authors_code')"]


@pytest.mark.quick
def test_authors_code_refusals():
    from fedbench.cli import refusal

    msg = refusal(["algo=fedavg", "server_opt=adagrad", "server_opt.variant=authors_code"])
    assert msg is not None and "server_opt.beta1=0.9" in msg and "no momentum" in msg
    msg = refusal(["algo=fedavg", "server_opt=yogi", "server_opt.initial_accumulator=1e-8"])
    assert msg is not None and "tau^2" in msg  # Algorithm 2: v_-1 >= tau^2
    assert refusal(["algo=fedavg", "server_opt=yogi", "server_opt.initial_accumulator=-1"])
    assert refusal(["algo=fedavg", "server_opt=adam", "server_opt.variant=code"])
    assert refusal(["algo=fedavg", "server_opt=adam", "server_opt.variant=authors_code"]) is None
