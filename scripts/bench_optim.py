"""The engine's optimizer step (`engine.optim.step_`): the in-place form against the
out-of-place form it replaced, seconds per step and their ratio, measured in one process.

The out-of-place form (`out_of_place_step`, fedbench 045eafa) made a fresh tensor per
operation: for pFedHN's hypernetwork (about 20M entries, SGD with momentum 0.9, weight
decay and a per-entry lr) five vectors of 80 MB per step, each a fresh allocation the
kernel pages in. The in-place form writes into the state and the parameters and makes as
few temporaries as the arithmetic needs (`consume_grad`: none, the gradient holds them),
with the same operations in the same order: every case also checks that both forms give
the same bits. Each time is the MIN over `--reps` steps, old and new interleaved.

    python scripts/bench_optim.py                        # P = 20M and 200k, every case
    python scripts/bench_optim.py --sizes 200000 --reps 20 --threads 2
"""

from __future__ import annotations

import argparse
import time

import torch

from fedbench.engine.optim import OptimConfig, init_state, step_

# (name, optimizer settings, per-entry lr): pFedHN's hypernetwork step is "sgd_m_wd_lrvec"
CASES = [
    ("sgd", dict(), False),
    ("sgd_wd", dict(weight_decay=1e-3), False),
    ("sgd_m", dict(momentum=0.9), False),
    ("sgd_m_wd_lrvec", dict(momentum=0.9, weight_decay=1e-3), True),
    ("sgd_nesterov_wd", dict(momentum=0.9, nesterov=True, weight_decay=1e-3), False),
    ("adam", dict(name="adam"), False),
    ("adam_wd", dict(name="adam", weight_decay=1e-4), False),
]
# the in-place form must not be slower than the old one (ratio old / new), up to the noise of
# a loaded machine on the cases where both run the same operations (plain SGD)
FLOOR = 0.8


def out_of_place_step(cfg, w, g, state, lr, active=None, mask=None) -> None:
    """`step_` as it was before it ran in place (fedbench 045eafa): a temporary per
    operation. The reference of tests/test_optim_step.py (the same bits)."""
    keep = active
    if mask is not None:
        keep = mask if keep is None else keep * mask
    if cfg.weight_decay:
        g = g.add(w, alpha=cfg.weight_decay)
    if cfg.name == "sgd":
        if cfg.momentum:
            buf = state["buf"]
            new_buf = buf.mul(cfg.momentum).add_(g)
            if keep is not None:
                new_buf = torch.where(keep.bool(), new_buf, buf)
            buf.copy_(new_buf)
            d = g.add(buf, alpha=cfg.momentum) if cfg.nesterov else buf
        else:
            d = g
    else:
        b1, b2 = cfg.betas
        m, v, step = state["m"], state["v"], state["step"]
        if keep is None:
            step.add_(1)
            m.mul_(b1).add_(g, alpha=1 - b1)
            v.mul_(b2).addcmul_(g, g, value=1 - b2)
        else:
            a = keep.bool()
            step.add_(1 if active is None else active)
            m.copy_(torch.where(a, m * b1 + g * (1 - b1), m))
            v.copy_(torch.where(a, v * b2 + g * g * (1 - b2), v))
        s = step.clamp(min=1)
        d = (m / (1 - b1**s)) / ((v / (1 - b2**s)).sqrt() + cfg.eps)
    if keep is not None:
        d = d * keep
    if isinstance(lr, torch.Tensor):
        w.sub_(d * lr)
    else:
        w.add_(d, alpha=-lr)


def bench_case(name: str, kw: dict, lr_vec: bool, P: int, reps: int) -> dict:
    """MIN seconds per step of the old form, the new one and the new one consuming g."""
    gen = torch.Generator().manual_seed(0)
    cfg = OptimConfig(lr=0.01, **kw)
    w0 = torch.randn(P, generator=gen)
    g0 = torch.randn(P, generator=gen) * 1e-2
    lr = torch.where(torch.arange(P) < P // 100, 0.02, 0.01) if lr_vec else 0.01
    forms = {
        "old": lambda w, g, st: out_of_place_step(cfg, w, g, st, lr),
        "new": lambda w, g, st: step_(cfg, w, g, st, lr),
        "consume": lambda w, g, st: step_(cfg, w, g, st, lr, consume_grad=True),
    }
    runs = {k: (w0.clone(), init_state(cfg, w0)) for k in forms}
    best = {k: float("inf") for k in forms}
    for _ in range(reps):
        for k, fn in forms.items():
            w, st = runs[k]
            g = g0.clone()  # consumed by one form: each form gets its own copy, not timed
            t0 = time.perf_counter()
            fn(w, g, st)
            best[k] = min(best[k], time.perf_counter() - t0)
    same = all(torch.equal(runs[k][0], runs["old"][0]) for k in forms)
    return {"case": name, "P": P, **best, "same_bits": same}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="20000000,200000", help="comma-separated P")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="CPU threads (torch)")
    ap.add_argument("--cases", default="all", help="comma-separated case names, or all")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cases = CASES if args.cases == "all" else [c for c in CASES if c[0] in args.cases.split(",")]
    print(f"{'case':<18}{'P':>10}{'old ms':>10}{'new ms':>10}{'consume':>10}"
          f"{'old/new':>9}{'old/cons':>9}  bits")  # fmt: skip
    bad = False
    for P in (int(s) for s in args.sizes.split(",")):
        for name, kw, lr_vec in cases:
            r = bench_case(name, kw, lr_vec, P, args.reps)
            ratio, ratio_c = r["old"] / r["new"], r["old"] / r["consume"]
            flag = "" if min(ratio, ratio_c) >= FLOOR else f"  BELOW FLOOR {FLOOR}"
            bad |= bool(flag) or not r["same_bits"]
            print(f"{name:<18}{P:>10}{r['old'] * 1e3:>10.2f}{r['new'] * 1e3:>10.2f}"
                  f"{r['consume'] * 1e3:>10.2f}{ratio:>9.2f}{ratio_c:>9.2f}  "
                  f"{'same' if r['same_bits'] else 'DIFFER'}{flag}")  # fmt: skip
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
