"""kNN-Per: the kNN probabilities against a brute-force computation, lambda's choice on
validation data, the interpolated prediction by hand (probabilities and the authors'
logits), FedAvg on the training part, the datastore's capacity, that it learns on real
FMNIST, and that a killed run resumes exactly."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from conftest import crash_and_resume, make_algo, run_small
from fedbench.algorithms.knnper import choose_lambda, knn_probs


def brute_knn(query, keys, labels, k, scale, num_classes):
    """h^kNN one query at a time: sort the datastore by squared distance, keep the first k,
    weigh each exp(-d2 / (F scale)), normalize."""
    F = query.shape[1]
    out = []
    for q in query.tolist():
        d2 = [sum((a - b) ** 2 for a, b in zip(q, key)) for key in keys.tolist()]
        near = sorted(range(len(d2)), key=lambda j: d2[j])[:k]
        w = {j: math.exp(-d2[j] / (F * scale)) for j in near}
        p = [0.0] * num_classes
        for j in near:
            p[int(labels[j])] += w[j] / sum(w.values())
        out.append(p)
    return torch.tensor(out, device=query.device)


@pytest.mark.quick
@pytest.mark.parametrize("k,scale", [(4, 0.7), (1, 1.0), (50, 0.05)])
def test_knn_probs_against_brute_force(k, scale):
    g = torch.Generator().manual_seed(0)
    query, keys = torch.randn(6, 5, generator=g), torch.randn(12, 5, generator=g)
    labels = torch.randint(0, 3, (12,), generator=g)
    got = knn_probs(query, keys, labels, k, scale, 4)
    torch.testing.assert_close(got, brute_knn(query, keys, labels, k, scale, 4))
    assert torch.all(got[:, 3] == 0) and torch.allclose(got.sum(1), torch.ones(6))
    # far neighbours: the weights' ratio survives where exp(-d2 / (F T)) underflows
    far = knn_probs(query, keys * 1e3, labels, k, 1e-3, 4)
    assert torch.isfinite(far).all() and torch.allclose(far.sum(1), torch.ones(6))


@pytest.mark.quick
def test_choose_lambda_best_validation_accuracy_ties_to_the_median():
    """Sample A (label 0) is right for lambda > 2/7, sample B (label 1) for lambda < 5/8:
    both for 0.3, 0.4, 0.5, 0.6 on the grid of step 0.1; the median of these maximizers is
    their lower middle, 0.4."""
    p_knn = torch.tensor([[1.0, 0.0], [0.8, 0.2]], dtype=torch.float64)
    p_glob = torch.tensor([[0.3, 0.7], [0.0, 1.0]], dtype=torch.float64)
    y = torch.tensor([0, 1])
    grid = torch.arange(11, dtype=torch.float64) / 10
    acc = [((lam * p_knn + (1 - lam) * p_glob).argmax(1) == y).float().mean() for lam in grid]
    best = [float(lam) for lam, a in zip(grid, acc) if a == max(acc)]
    assert best == [0.3, 0.4, 0.5, 0.6]
    assert choose_lambda(grid, p_knn, p_glob, y) == 0.4


@pytest.mark.quick
@pytest.mark.parametrize("mix", ["probs", "logits"])
def test_prediction_by_hand(mix):
    """Client i: the datastore is (phi(x), y) of its training part under the global model w
    (evaluation mode), lambda_i the grid value with the best validation accuracy, the
    prediction argmax of lambda_i h^kNN + (1 - lambda_i) h_S on any samples."""
    algo, eng, fed = make_algo("knnper", ["algo.k=3", "algo.lambda_step=0.05", f"algo.mix={mix}"])
    algo.round(0, np.arange(3))
    model = eng.to_module(algo.w, algo.model_fn().to(algo.device)).eval()

    def embed(idx):
        with torch.no_grad():
            f = model.features(fed.x[idx])
            z = model.head(f)
        return f, (torch.softmax(z, -1) if mix == "probs" else z), fed.y[idx]

    grid = [j * 0.05 for j in range(21)]
    for i in range(3):
        keys, _, labels = embed(algo.trainer.fed.train_idx[i])
        fv, gv, yv = embed(algo.val_idx[i])
        pv = brute_knn(fv, keys, labels, 3, 1.0, 3)
        acc = [float(((l * pv + (1 - l) * gv).argmax(1) == yv).float().mean()) for l in grid]
        best = [l for l, a in zip(grid, acc) if a == max(acc)]
        lam = best[(len(best) - 1) // 2]
        idx = torch.cat([fed.test_idx[i], fed.test_idx[(i + 1) % 3]])
        fq, gq, yq = embed(idx)
        want = lam * brute_knn(fq, keys, labels, 3, 1.0, 3) + (1 - lam) * gq
        p, y, got_lam = algo.predict(i, idx)
        assert got_lam == pytest.approx(lam) and torch.equal(y, yq)
        torch.testing.assert_close(p, want)
        assert torch.equal(algo.personal_correct(i, idx), want.argmax(1) == yq)


@pytest.mark.quick
def test_fedavg_on_the_training_part_and_the_split():
    """val_frac of each client's samples are held out (disjoint from the training part,
    together its whole pool); FedAvg trains on the training part and averages by its
    sizes; the global model is w."""
    algo, eng, fed = make_algo("knnper")
    for i in range(3):
        val, train = algo.val_idx[i], algo.trainer.fed.train_idx[i]
        assert len(val) == max(1, int(0.2 * len(fed.train_idx[i])))
        both = torch.sort(torch.cat([val, train])).values
        assert torch.equal(both, fed.train_idx[i])
    w0, clients = algo.w.clone(), np.array([0, 2])
    trained = algo.trainer.train(w0, clients, optim=algo.optim, lr=0.1, batch_size=8, epochs=1)
    n = torch.tensor(
        [float(len(algo.trainer.fed.train_idx[i])) for i in clients], device=algo.device
    )
    info = algo.round(0, clients)
    torch.testing.assert_close(algo.w, (n[:, None] / n.sum() * trained.states).sum(0))
    assert torch.equal(algo.global_state(), algo.w) and torch.equal(algo.personal_state(1), algo.w)
    assert info.comm.bytes_up == info.comm.bytes_down == 4 * 2 * eng.n_state


@pytest.mark.quick
def test_capacity_keeps_a_seeded_subset_of_the_training_part():
    algo, _, _ = make_algo("knnper", ["algo.capacity=10"])
    for i in range(3):
        store, train = algo.datastore(i), algo.trainer.fed.train_idx[i]
        assert len(store) == min(10, len(train)) and bool(torch.isin(store, train).all())
        assert torch.equal(store, algo.datastore(i))


@pytest.mark.slow
def test_learns_on_fmnist(tmp_path):
    """Measured 0.964 in 3 rounds (seed 0); the global model alone (lambda = 0) 0.56."""
    summary, _ = run_small(tmp_path, ["algo=knnper", "optim.lr=0.1"], rounds=3)
    acc = summary["final"]["personal"]["L"]["avg"]
    assert acc > 0.9, acc
    assert summary["final"]["global"]["L"]["avg"] < 0.75


@pytest.mark.slow
@pytest.mark.long  # every algorithm's state round trip stays quick (test_checkpoint)
def test_resume_is_exact(tmp_path, monkeypatch):
    over = ["algo=knnper", "eval.every=2", "checkpoint.every=2", "participation=0.5"]
    full, resumed = crash_and_resume(tmp_path, monkeypatch, over, 4, die_at=3)
    assert (full["final"], full["best"]) == (resumed["final"], resumed["best"])
