"""FedSLR's server prox: seconds per round of the per-layer nuclear-norm prox on ResNet-18
(GroupNorm, CIFAR-100 head) next to the round's local training time.

The prox (`engine.prox.nuclear_prox`) is one thin SVD per weight matrix (Conv (o, i, kh, kw)
viewed as (o·kh, i·kw)), batched over the matrices of one shape. Measured, on one device:
- prox with each `algo.prox_solver`: svd (batched thin SVD, float32: the authors' code),
  svd64 (the same in float64: the reference), gram (eigh of the smaller Gram matrix, float64),
  and a per-layer loop of float32 SVDs (no batching); the MIN over `--reps` calls on a
  GKR-like state (the initial weights);
- training: seconds per local SGD step (ResNet-18, batch 20, 3x32x32, weight decay), MIN
  over `--steps` steps after warm-up, times the steps of one FedSLR round of the paper's
  setting: 10 clients x (E = 2 Phase I epochs + 1 Phase II epoch) x 25 batches of 20
  (500 samples per client: CIFAR 50,000 / 100 clients) = 750 steps.
The result the prox must keep: each solver against the float64 SVD (max abs difference of
the new weights, and equal ranks). `--threads` (default 1): CPU threads; on a shared,
loaded machine more threads than free cores make LAPACK's SVD many times slower.

    python scripts/bench_fedslr_prox.py                     # CPU (and CUDA if present)
    python scripts/bench_fedslr_prox.py --device cpu --reps 3 --steps 5
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from fedbench.engine.prox import matrix_entries, nuclear_prox, svt, to_matrix
from fedbench.engine.spec import ModelSpec
from fedbench.models import build_model

ROUND_STEPS = 10 * (2 + 1) * 25  # clients x (Phase I + Phase II epochs) x batches per epoch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device, reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def loop_prox(w: torch.Tensor, spec: ModelSpec, tau: float) -> torch.Tensor:
    """The unbatched reference: one SVD call per layer."""
    out = w.clone()
    for e in matrix_entries(spec):
        m = to_matrix(w[e.start : e.stop].view(e.shape))
        new, _ = svt(m, tau)
        out[e.start : e.stop] = new.reshape(-1)  # (values only used for timing)
    return out


def bench(device: torch.device, reps: int, steps: int, tau: float, loop: bool) -> dict:
    torch.manual_seed(0)
    model = build_model("resnet18", (3, 32, 32), 100, norm="group", gn_groups=2).to(device)
    spec = ModelSpec(model)
    w = spec.flatten(model).to(device)
    nuclear_prox(w, spec, tau)  # warm-up (CUDA: library load)
    ref, rref = nuclear_prox(w, spec, tau, solver="svd64")
    out: dict = {}
    for solver in ("svd", "svd64", "gram"):
        out[f"prox_{solver}_s"] = timed(
            lambda s=solver: nuclear_prox(w, spec, tau, s), device, reps
        )
        a, ra = nuclear_prox(w, spec, tau, solver)
        out[f"diff_{solver}"] = float((a - ref).abs().max())
        out[f"same_ranks_{solver}"] = [r.rank for r in ra] == [r.rank for r in rref]
    if loop:
        out["prox_loop_s"] = timed(lambda: loop_prox(w, spec, tau), device, reps)

    opt = torch.optim.SGD(model.parameters(), lr=0.1, weight_decay=1e-3)
    x = torch.randn(20, 3, 32, 32, device=device)
    y = torch.randint(0, 100, (20,), device=device)

    def step():
        opt.zero_grad(set_to_none=False)
        F.cross_entropy(model(x), y).backward()
        opt.step()

    for _ in range(2):
        step()
    t_step = timed(step, device, steps)
    return {
        "device": str(device),
        "matrices": len(matrix_entries(spec)),
        "shapes": len({tuple(e.shape) for e in matrix_entries(spec)}),
        "params": spec.n_params,
        **out,
        "ranks": sum(r.rank for r in rref),
        "full_ranks": sum(r.full for r in rref),
        "step_s": t_step,
        "round_train_s": t_step * ROUND_STEPS,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default=None, help="cpu | cuda (default: cpu, and cuda if present)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--tau", type=float, default=1e-3, help="lambda_r / alpha (paper: 1e-4 / 0.1)")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads (torch.set_num_threads)")
    ap.add_argument("--loop", action="store_true", help="also time the unbatched per-layer loop")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    devices = (
        [args.device] if args.device else ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    )
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, tau {args.tau}")
    for d in devices:
        r = bench(torch.device(d), args.reps, args.steps, args.tau, args.loop)
        print(
            f"[{r['device']}] ResNet-18 GN (CIFAR-100 head), {r['params']:,} params, "
            f"{r['matrices']} matrices in {r['shapes']} shapes; ranks after the prox "
            f"{r['ranks']} of {r['full_ranks']}"
        )
        for solver in ("svd", "svd64", "gram"):
            print(
                f"  prox {solver:6s} {r[f'prox_{solver}_s']:7.3f} s per round "
                f"({r[f'prox_{solver}_s'] / r['round_train_s']:.2%} of training); vs svd64: "
                f"max |diff| {r[f'diff_{solver}']:.1e}, same ranks {r[f'same_ranks_{solver}']}"
            )
        if "prox_loop_s" in r:
            print(f"  prox svd per-layer loop (unbatched) {r['prox_loop_s']:.3f} s")
        print(
            f"  training: {r['step_s'] * 1e3:.1f} ms per step x {ROUND_STEPS} steps = "
            f"{r['round_train_s']:.1f} s per round"
        )


if __name__ == "__main__":
    main()
