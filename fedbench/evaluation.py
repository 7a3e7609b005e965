"""Per-client accuracy and its summaries (docs/metrics.md).

For every client i and each model kind (`personal`, `global`): accuracy on the client's own
test set (L), on a mixture with other clients' test sets (S) and on a sample of the union
of all test sets (G), and, with `split.val_frac` > 0, on its own validation set (V: carved
out of its training share; what a round or a hyperparameter is selected by). Correctness is
computed on the device; one transfer at the end.

`eval.select` names the evaluation a run reports as `selected` (summary.json): `val` the
one with the best V avg, `last` the last one, `best_test` the one with the best L avg
(today's `best`: chosen on the test set, so optimistic); `auto` is `val` with validation
data, else `last`.
"""

from __future__ import annotations

import math
from functools import partial

import numpy as np
import torch

TEST_SETS = ("L", "S", "G")  # drawn from the clients' test sets
VAL = "V"  # the clients' validation sets
SETS = (*TEST_SETS, VAL)
STATS = ("avg", "weighted", "std", "top5", "bottom5", "min", "max")
SELECT = ("val", "last", "best_test")  # eval.select's rules (and `auto`)


def summarize(acc: np.ndarray, sizes: np.ndarray | None = None, tail: float = 0.05) -> dict:
    """avg (uniform over clients), weighted (by samples), std (population), top5/bottom5
    (mean of the best/worst ceil(tail * N) clients), min, max."""
    acc = np.asarray(acc, dtype=np.float64)
    if acc.size == 0:
        return {k: float("nan") for k in STATS}
    k = max(1, math.ceil(tail * acc.size))
    s = np.sort(acc)
    w = np.ones_like(acc) if sizes is None else np.asarray(sizes, dtype=np.float64)
    return {
        "avg": float(acc.mean()),
        "weighted": float((acc * w).sum() / w.sum()),
        "std": float(acc.std()),
        "top5": float(s[-k:].mean()),
        "bottom5": float(s[:k].mean()),
        "min": float(s[0]),
        "max": float(s[-1]),
    }


def _sets(fed, i: int) -> dict[str, torch.Tensor]:
    out = {"L": fed.test_idx[i]}
    if fed.s_idx is not None:
        out["S"] = fed.s_idx[i]
    if fed.g_idx is not None:
        out["G"] = fed.g_idx[i]
    if getattr(fed, "val_idx", None) is not None:
        out[VAL] = fed.val_idx[i]
    return out


def _per_client(fed, correct, tail: float, ids=None) -> dict:
    """Every client's hits on its L/S/G sets from `correct(i, idx)`, packed (clients `ids`,
    default all)."""
    hits: dict[str, list[torch.Tensor]] = {}
    sizes: dict[str, list[int]] = {}
    for i in range(fed.num_clients) if ids is None else ids:
        sets = _sets(fed, i)
        ok = correct(i, torch.cat(list(sets.values())))
        for (name, ix), part in zip(sets.items(), torch.split(ok, [len(v) for v in sets.values()])):
            hits.setdefault(name, []).append(part.sum())
            sizes.setdefault(name, []).append(len(ix))
    return _pack(hits, sizes, tail, ids)


@torch.no_grad()
def evaluate(algo, fed, tail: float = 0.05, honest=None) -> dict:
    """{'personal': {'L': {'acc': [N], 'n': [N], 'summary': {...}}, ...}, 'global': ... | None,
    and one entry per `algo.extra_kinds` (per-client predictors scored like 'personal')}.

    `honest` ([N] bool, malicious clients False; `fedbench.attack`): only honest clients are
    scored and summarized; each set then carries `ids`, the clients its rows belong to."""
    result: dict = {"personal": None, "global": None}
    N = fed.num_clients
    ids = None if honest is None else [int(i) for i in np.flatnonzero(honest)]
    if algo.has_personal:
        result["personal"] = _per_client(fed, algo.personal_correct, tail, ids)
    if algo.has_global:
        # The global model is the same for every client: score the union of test samples
        # (and of validation samples, when there are any) once.
        union = torch.unique(torch.cat(fed.test_idx))
        val_idx = getattr(fed, "val_idx", None)
        scored = union if val_idx is None else torch.unique(torch.cat([union, *val_idx]))
        ok_pool = torch.zeros(fed.y.numel(), dtype=torch.bool, device=fed.y.device)
        ok_pool[scored] = algo.global_correct(scored)
        hits, sizes = {}, {}
        for i in range(N) if ids is None else ids:
            for name, ix in _sets(fed, i).items():
                hits.setdefault(name, []).append(ok_pool[ix].sum())
                sizes.setdefault(name, []).append(len(ix))
        packed = _pack(hits, sizes, tail, ids)
        # `all` (the GM column): the pooled test sets of the scored clients (honest only
        # under an attack; the S/G rows above may still draw on any client's test samples)
        pooled = union if ids is None else torch.unique(torch.cat([fed.test_idx[i] for i in ids]))
        packed["all"] = float(ok_pool[pooled].float().mean().item()) if pooled.numel() else 0.0
        result["global"] = packed
    for kind in algo.extra_kinds:
        result[kind] = _per_client(fed, partial(algo.extra_correct, kind), tail, ids)
    return result


def _pack(hits: dict, sizes: dict, tail: float, ids=None) -> dict:
    out = {}
    for name in hits:
        n = np.asarray(sizes[name], dtype=np.float64)
        correct = torch.stack(hits[name]).cpu().numpy().astype(np.float64)
        acc = np.divide(correct, n, out=np.zeros_like(n), where=n > 0)
        out[name] = {"acc": acc, "n": n, "summary": summarize(acc, n, tail)}
        if ids is not None:
            out[name]["ids"] = np.asarray(ids)
    return out


def summaries(result: dict) -> dict:
    """The nested summary dict of summary.json: {'personal': {'L': {...}}, 'global': {...}}."""
    out: dict = {}
    for kind, r in result.items():
        if r is None:
            out[kind] = None
            continue
        out[kind] = {s: r[s]["summary"] for s in SETS if s in r}
        if "all" in r:
            out[kind]["all"] = r["all"]
    return out


def resolve_select(select: str, has_val: bool) -> str:
    """eval.select's rule: `auto` is `val` with validation data, else `last`."""
    if select == "auto":
        return "val" if has_val else "last"
    return select


def model_kind(ev: dict) -> str:
    """The model an evaluation's round is chosen by: personal where there is one."""
    return "personal" if ev.get("personal") else "global"


def score(ev: dict | None, set_name: str) -> float | None:
    """An evaluation's (a summary block's) avg accuracy on `set_name` of `model_kind`."""
    if not ev:
        return None
    node = (ev.get(model_kind(ev)) or {}).get(set_name)
    return float(node["avg"]) if isinstance(node, dict) and "avg" in node else None


def better(new: dict, old: dict | None, set_name: str) -> bool:
    """Whether evaluation `new` beats `old` on `set_name` (strictly: a tie keeps the
    earlier round; a NaN never wins)."""
    a = score(new, set_name)
    if a is None or a != a:
        return False
    b = score(old, set_name)
    return b is None or b != b or a > b


def selected(rule: str, final: dict, best_test: dict | None, best_val: dict | None) -> dict:
    """summary.json's `selected` block: {'by': rule, 'round': ..., <the chosen evaluation>}.
    `rule` is resolved (val | last | best_test); `val` without a validated evaluation falls
    back to nothing chosen (an empty evaluation with by=val)."""
    block = {"last": final, "best_test": best_test, "val": best_val}[rule]
    return {"by": rule, **(block or {})}
