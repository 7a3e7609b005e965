"""The round loop: build the federation, model, engine and algorithm from a config; sample
clients; train; evaluate every `eval.every` rounds and at the end; write metrics.

Files written into the run directory (all atomically): partition.json, metrics.csv,
clients.csv, summary.json (shapes in specs/metrics.md).
"""

from __future__ import annotations

import io
import logging
import math
import time
from functools import partial
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

import fedbench
from fedbench.algorithms import ALGORITHMS
from fedbench.algorithms.base import FLOAT_BYTES
from fedbench.algorithms.params import check_params
from fedbench.attack import Attack
from fedbench.data.federation import Federation
from fedbench.data.sources import load_dataset
from fedbench.data.splits import eval_sets, make_partition
from fedbench.engine import Engine
from fedbench.errors import ConfigError, FedbenchError
from fedbench.evaluation import SETS, evaluate, summaries
from fedbench.io import atomic_write_bytes, atomic_write_json, atomic_write_text
from fedbench.models import build_model

log = logging.getLogger("fedbench")

CHECKPOINT = "checkpoint.pt"


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise FedbenchError(
                f"device={name} but no CUDA GPU is visible (torch.cuda.is_available() is "
                "False); use device=auto or device=cpu"
            )
        return torch.device(name)
    if name == "cpu":
        return torch.device("cpu")
    raise ConfigError(f"device={name!r}; valid: auto, cpu, cuda, cuda:N")


def clients_per_round(participation: float | int, n: int) -> int:
    """A fraction in (0, 1] of the clients, or an integer count > 1."""
    p = float(participation)
    if p <= 0:
        raise ConfigError(f"participation={participation} must be > 0")
    if p <= 1.0:
        return max(1, round(p * n))
    if p != int(p) or p > n:
        raise ConfigError(f"participation={participation}: a fraction in (0, 1] or a count <= {n}")
    return int(p)


def validate(cfg: DictConfig) -> None:
    """Top-level numbers Hydra does not type-check: one clear line instead of a traceback."""
    for key in ("rounds", "clients", "local_epochs", "batch_size", "seed"):
        v = cfg.get(key)
        minimum = 0 if key == "seed" else 1
        if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
            raise ConfigError(f"{key}={v!r} must be an integer >= {minimum}")
    if not isinstance(cfg.eval.every, int) or cfg.eval.every < 1:
        raise ConfigError(f"eval.every={cfg.eval.every!r} must be an integer >= 1")


# Keys a resumed run may change: how long it runs, how it is evaluated and checkpointed, where
# it computes and finds its files. Everything else decides the run's numbers: a resume that
# changes it stops. (`rounds` may grow: APPLE's L = l_frac * rounds and FedSpa's cosine
# schedule follow it.)
RESUME_MAY_CHANGE = (
    "rounds",
    "eval",
    "checkpoint",
    "device",
    "engine",
    "resume",
    "data.root",
    "data.download",
)


def _flat_items(node, prefix: str = "") -> dict:
    """{dotted key: leaf value} of a plain nested dict (lists are leaves)."""
    if not isinstance(node, dict):
        return {prefix: node}
    out = {}
    for k, v in node.items():
        out.update(_flat_items(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def resume_differences(saved: dict, now: dict) -> list[str]:
    """'key (checkpoint -> now)' for every key outside RESUME_MAY_CHANGE that differs."""
    a, b = _flat_items(saved), _flat_items(now)
    missing = object()
    out = []
    for k in sorted(set(a) | set(b)):
        if any(k == p or k.startswith(p + ".") for p in RESUME_MAY_CHANGE):
            continue
        va, vb = a.get(k, missing), b.get(k, missing)
        if va != vb:
            show = lambda v: "absent" if v is missing else repr(v)  # noqa: E731
            out.append(f"{k} ({show(va)} -> {show(vb)})")
    return out


def check_resume(cfg: DictConfig, out: str | Path) -> None:
    """With resume=true: raise ConfigError (one line, before any file is written) unless the
    checkpoint in `out` was written by a run of this config, up to RESUME_MAY_CHANGE, and
    `rounds` is at least the rounds it has done."""
    out = Path(out)
    path = out / CHECKPOINT
    if not path.exists():
        if (out / "summary.json").exists():
            raise ConfigError(
                f"resume=true: {out} holds a finished run without {CHECKPOINT} "
                "(checkpoint.every=0); start a new run directory"
            )
        return
    state = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    saved = state.get("config")
    if saved is None:
        log.warning("%s has no saved config (an older fedbench): resuming unchecked", path)
        return
    diff = resume_differences(saved, _plain(cfg))
    if diff:
        raise ConfigError(
            f"resume=true: the config differs from {path}'s in {', '.join(diff)}; resume with "
            f"the checkpoint's values or start a new run directory (only "
            f"{', '.join(RESUME_MAY_CHANGE)} may change)"
        )
    done = int(state["progress"]["next_round"])
    if int(cfg.rounds) < done:
        raise ConfigError(
            f"resume=true: rounds={cfg.rounds} but {path} has {done} rounds done; "
            f"rounds must be >= {done}"
        )


def _plain(cfg_node) -> dict:
    return dict(OmegaConf.to_container(cfg_node, resolve=True)) if cfg_node is not None else {}


class Run:
    """Everything a run is built from; `Run(cfg, out_dir).run()` is what the CLI calls."""

    def __init__(self, cfg: DictConfig, out_dir: str | Path, progress: bool = True) -> None:
        self.cfg = cfg
        self.out = Path(out_dir)
        self.progress = progress
        validate(cfg)
        algo_cls = ALGORITHMS.get(str(cfg.algo.name))
        check_params(cfg.algo, algo_cls.Params, str(cfg.algo.name))
        if cfg.resume:
            check_resume(cfg, self.out)
        self.device = resolve_device(str(cfg.device))
        seed = int(cfg.seed)
        dcfg = _plain(cfg.data)
        name = dcfg.pop("name")
        root = dcfg.pop("root", None)
        download = bool(dcfg.pop("download", True))
        augment = bool(dcfg.pop("augment", False))
        root = str(Path(root).expanduser()) if root else None
        data = load_dataset(name, root, download=download, **dcfg)
        scfg = _plain(cfg.split)
        split = scfg.pop("name")
        n = int(cfg.clients)
        self.partition = make_partition(
            data.y_train.numpy(), data.y_test.numpy(), n, seed, split, scfg
        )
        s_idx, g_idx = eval_sets(self.partition, seed, float(cfg.eval.s_frac))
        self.eval_sets = {"S": [i.tolist() for i in s_idx], "G": [i.tolist() for i in g_idx]}
        self.fed = Federation(
            data, self.partition, self.device, s_idx=s_idx, g_idx=g_idx, augment=augment, seed=seed
        )
        self.labels_pool = np.concatenate([data.y_train.numpy(), data.y_test.numpy()])
        self.num_classes = data.num_classes
        mcfg = _plain(cfg.model)
        mname = mcfg.pop("name")
        self.model_fn = partial(build_model, mname, data.input_shape, data.num_classes, **mcfg)
        torch.manual_seed(seed)
        model = self.model_fn()
        ecfg = cfg.engine
        self.engine = Engine(
            self.fed,
            model,
            device=self.device,
            seed=seed,
            backend=str(ecfg.backend),
            drop_last=bool(ecfg.drop_last),
            eval_batch_size=int(cfg.eval.batch_size),
            chunk_clients=None if ecfg.get("chunk_clients") is None else int(ecfg.chunk_clients),
            memory_budget=None if ecfg.get("memory_budget") is None else float(ecfg.memory_budget),
        )
        self.algo = algo_cls(cfg, self.fed, self.engine, self.model_fn)
        # malicious clients (fedbench/attack.py): they act in Algorithm.receive only
        self.attack = Attack.from_cfg(cfg, n)
        if self.attack is not None:
            if not algo_cls.attackable:
                raise ConfigError(
                    f"attack.kind={cfg.attack.kind}: algo={cfg.algo.name} does not route its "
                    "uploads through Algorithm.receive, so the attack cannot reach it"
                )
            self.algo.attack = self.attack
        self.honest = None if self.attack is None else self.attack.honest
        self._warned_collapse = False  # one warning per run when an attacked run diverges
        self.per_round = clients_per_round(cfg.participation, n)
        self.sampler = np.random.default_rng([seed, 7])

    # ------------------------------------------------------------------ loop
    def sample(self) -> np.ndarray:
        n = self.fed.num_clients
        if self.per_round == n:
            return np.arange(n)
        return np.sort(self.sampler.choice(n, self.per_round, replace=False))

    def run(self) -> dict:
        cfg = self.cfg
        self.out.mkdir(parents=True, exist_ok=True)
        atomic_write_json(
            self.out / "partition.json", {**self.partition.to_json(), "eval_sets": self.eval_sets}
        )
        log.info(
            "%s on %s (%s split, %d clients, %d per round), model %s: %d parameters; device %s",
            cfg.algo.name,
            cfg.data.name,
            cfg.split.name,
            self.fed.num_clients,
            self.per_round,
            cfg.model.name,
            self.engine.n_params,
            self.device,
        )
        log.info("partition:\n%s", self.partition.summary(self.labels_pool, self.num_classes))
        rounds = int(cfg.rounds)
        every = max(1, int(cfg.eval.every))
        ckpt_every = int(cfg.checkpoint.every or 0)
        tail = float(cfg.eval.tail)
        # Everything the loop accumulates: checkpointed with the algorithm so that a resumed
        # run ends exactly as an uninterrupted one.
        self.progress_state = {
            "next_round": 0,
            "elapsed_s": 0.0,
            "comm": {"bytes_up": 0, "bytes_down": 0},
            "best": None,
            "final": None,
            "metric_rows": [],
            "client_rows": [],
        }
        if cfg.resume:
            self._restore()
        st = self.progress_state
        comm = st["comm"]
        t0 = time.perf_counter() - st["elapsed_s"]
        bar = tqdm(
            range(st["next_round"], rounds),
            desc=str(cfg.algo.name),
            disable=not self.progress,
            leave=False,
            initial=st["next_round"],
            total=rounds,
        )
        for t in bar:
            clients = self.sample()
            info = self.algo.round(t, clients)
            comm["bytes_up"] += int(info.get("bytes_up", 0))
            comm["bytes_down"] += int(info.get("bytes_down", 0))
            if (t + 1) % every == 0 or t + 1 == rounds:
                loss = float(info.get("train_loss", float("nan")))
                if not math.isfinite(loss):
                    if self.attack is None:
                        raise FedbenchError(
                            f"training diverged at round {t + 1} (loss {loss}); lower optim.lr"
                        )
                    # under attack a collapse is the outcome measured (FedPG Table 3): go on
                    if not self._warned_collapse:
                        self._warned_collapse = True
                        log.warning(
                            "training diverged at round %d under attack.kind=%s (loss %s); "
                            "the run goes on and scores the collapsed models",
                            t + 1,
                            cfg.attack.kind,
                            loss,
                        )
                res = evaluate(self.algo, self.fed, tail, honest=self.honest)
                summ = summaries(res)
                row = {"round": t + 1, "wall_time_s": time.perf_counter() - t0, "train_loss": loss}
                row.update(comm)
                row.update(diagnostics(info))
                row.update(size_columns(self.algo, comm, t + 1, info, len(clients)))
                row.update(_flatten(summ))
                st["metric_rows"].append(row)
                st["client_rows"].append(_client_frame(t + 1, res))
                st["final"] = {"round": t + 1, **summ}
                if st["best"] is None or _key(st["final"]) > _key(st["best"]):
                    st["best"] = st["final"]
                self._write_metrics()
                bar.set_postfix_str(_postfix(summ))
            st["next_round"] = t + 1
            # the last round too: a finished run can be extended (rounds=<more> resume=true)
            if ckpt_every and ((t + 1) % ckpt_every == 0 or t + 1 == rounds):
                st["elapsed_s"] = time.perf_counter() - t0
                self._checkpoint()
        wall = time.perf_counter() - t0
        summary = {
            "algo": str(cfg.algo.name),
            "data": str(cfg.data.name),
            "split": str(cfg.split.name),
            "model": str(cfg.model.name),
            "seed": int(cfg.seed),
            "rounds": rounds,
            "clients": self.fed.num_clients,
            "participation": float(cfg.participation),
            "wall_time_s": round(wall, 3),
            "device": str(self.device),
            "version": fedbench.__version__,
            "final": st["final"],
            "best": st["best"],
            "malicious": 0 if self.attack is None else self.attack.count,
        }
        if st["metric_rows"]:
            last = st["metric_rows"][-1]
            summary["size"] = {k: last[k] for k in SIZE_KEYS if k in last}
        atomic_write_json(self.out / "summary.json", summary)
        return summary

    # ------------------------------------------------------------------ checkpoints
    def _checkpoint(self) -> None:
        """Algorithm state, engine optimizer state, RNG states and metrics so far, atomically."""
        state = {
            "progress": self.progress_state,
            "algo": self.algo.state_dict(),
            "engine": self.engine.state_dict(),
            "sampler": self.sampler.bit_generator.state,
            "augment": self.fed.rng_state(),
            # the attack's Gaussian stream (A1), so that a resumed run draws the same noise
            "attack": None if self.attack is None else self.attack.rng_state(),
            "version": fedbench.__version__,
            "config": _plain(self.cfg),  # resume=true checks the new config against it
        }
        buf = io.BytesIO()
        torch.save(state, buf)
        atomic_write_bytes(self.out / CHECKPOINT, buf.getvalue())

    def _restore(self) -> None:
        path = self.out / CHECKPOINT
        if not path.exists():  # check_resume refused a finished run without a checkpoint
            log.info("resume=true but no %s in %s: starting from round 0", CHECKPOINT, self.out)
            return
        state = torch.load(path, map_location=self.device, weights_only=False)
        self.progress_state = state["progress"]
        self.algo.load_state_dict(state["algo"])
        self.engine.load_state_dict(state["engine"])
        self.sampler.bit_generator.state = state["sampler"]
        self.fed.set_rng_state(state["augment"])
        if self.attack is not None and state.get("attack") is not None:
            self.attack.set_rng_state(state["attack"])
        log.info("resumed from %s at round %d", path, self.progress_state["next_round"])

    def _write_metrics(self) -> None:
        st = self.progress_state
        atomic_write_text(
            self.out / "metrics.csv", pd.DataFrame(st["metric_rows"]).to_csv(index=False)
        )
        frames = pd.concat(st["client_rows"], ignore_index=True)
        atomic_write_text(self.out / "clients.csv", frames.to_csv(index=False))


ROUND_KEYS = ("train_loss", "bytes_up", "bytes_down")


def diagnostics(info: dict) -> dict:
    """The scalars a round reports beyond loss and bytes (FedPG's QP fallbacks, FedSLR's
    ranks ...), as metrics.csv columns. Counters are cumulative on the algorithm's side."""
    out = {}
    for k, v in info.items():
        if k in ROUND_KEYS:
            continue
        if isinstance(v, torch.Tensor) and v.numel() == 1:
            v = v.item()
        if isinstance(v, int | float) and not isinstance(v, bool):
            out[k] = v
    return out


SIZE_KEYS = (
    "up_MB",
    "down_MB",
    "comm_MB",
    "params_sent_M",
    "params_personal_M",
    "params_global_M",
)


def size_columns(algo, comm: dict, rounds_done: int, info: dict, n_clients: int) -> dict:
    """Model size and communication (FedSLR Table 2), as metrics.csv columns: uplink,
    downlink and their sum in MB (1e6 bytes) per round, averaged over the rounds so far;
    parameters the server sent one client this round (from bytes_down); parameters of each
    deployed model (`Algorithm.model_size`; personal: mean over clients), in millions."""
    mb = 1e6 * max(rounds_done, 1)
    out = {
        "up_MB": comm["bytes_up"] / mb,
        "down_MB": comm["bytes_down"] / mb,
        "comm_MB": (comm["bytes_up"] + comm["bytes_down"]) / mb,
        "params_sent_M": float(info.get("bytes_down", 0)) / FLOAT_BYTES / max(n_clients, 1) / 1e6,
    }
    for k, v in algo.model_size().items():
        out[f"{k}_M"] = float(v) / 1e6
    return out


def _key(s: dict) -> float:
    kind = "personal" if s.get("personal") else "global"
    return s[kind]["L"]["avg"]


def _flatten(summ: dict) -> dict:
    row = {}
    for kind, sets in summ.items():
        if sets is None:
            continue
        for name, stats in sets.items():
            if isinstance(stats, dict):
                for k, v in stats.items():
                    row[f"{kind}.{name}.{k}"] = v
            else:
                row[f"{kind}.{name}"] = stats
    return row


def _client_frame(t: int, res: dict) -> pd.DataFrame:
    parts = []
    for kind, sets in res.items():
        if sets is None:
            continue
        for name in SETS:
            if name in sets:
                acc = sets[name]["acc"]
                parts.append(
                    pd.DataFrame(
                        {
                            "round": t,
                            "client": sets[name].get("ids", np.arange(acc.size)),
                            "model": kind,
                            "metric": name,
                            "value": acc,
                        }
                    )
                )
    return pd.concat(parts, ignore_index=True)


def _postfix(summ: dict) -> str:
    parts = []
    for kind in ("personal", "global"):
        if summ.get(kind):
            parts.append(f"{kind[0]}.acc={summ[kind]['L']['avg']:.3f}")
    return " ".join(parts)


def final_table(summary: dict) -> str:
    """The final table: per model kind, L avg / top5 / bottom5 / std and S, G avg (%)."""
    rows = {}
    for kind, s in (summary["final"] or {}).items():
        if not isinstance(s, dict):
            continue
        row = {}
        for k in ("avg", "top5", "bottom5", "std"):
            row[f"L.{k}"] = 100 * s["L"][k]
        for name in ("S", "G"):
            if name in s:
                row[f"{name}.avg"] = 100 * s[name]["avg"]
        if "all" in s:
            row["all"] = 100 * s["all"]
        rows[kind] = row
    df = pd.DataFrame(rows).T
    head = (
        f"{summary['algo']} | {summary['data']} {summary['split']} | {summary['model']} | "
        f"seed {summary['seed']} | round {summary['final']['round']} | "
        f"{summary['wall_time_s']:.1f} s on {summary['device']}  (accuracy %)"
    )
    return head + "\n" + df.to_string(float_format=lambda v: f"{v:6.2f}", na_rep="-")
