"""The methods of the two libraries researchers compare fedbench with, as read from their
server modules: a fixed snapshot, so that the README's "which of ours they also have" and
"which of theirs we do not yet have" are computed, never edited (fedbench/algorithms/_about.py).

An algorithm says that a library has it with `About(pfllib="FedRep", fl_bench="FedRep")`:
each name must be a key below (tests/test_docs_tables.py checks it). A method of theirs that
no `About` names is listed as one we do not yet have. To refresh the snapshot, list the
server modules at a newer commit and update the dicts and the commit together.
"""

from __future__ import annotations

# PFLlib (github.com/TsingZ0/PFLlib), system/flcore/servers/server*.py at commit
# d832e76f6a23b833038949ec1e4fdefe63a4d350 (2025-11-29); serverbase.py is no method.
PFLLIB_COMMIT = "d832e76f6a23b833038949ec1e4fdefe63a4d350"
PFLLIB: dict[str, str] = {
    "APFL": "serverapfl.py",
    "APPLE": "serverapple.py",
    "Ditto": "serverditto.py",
    "FD": "serverfd.py",
    "FML": "serverfml.py",
    "FedALA": "serverala.py",
    "FedAMP": "serveramp.py",
    "FedAS": "serveras.py",
    "FedAvg": "serveravg.py",
    "FedBABU": "serverbabu.py",
    "FedBN": "serverbn.py",
    "FedCAC": "servercac.py",
    "FedCP": "servercp.py",
    "FedCross": "servercross.py",
    "FedDA": "serverda.py",
    "FedDBE": "serverdbe.py",
    "FedDyn": "serverdyn.py",
    "FedFomo": "serverfomo.py",
    "FedGC": "servergc.py",
    "FedGen": "servergen.py",
    "FedGH": "servergh.py",
    "FedKD": "serverkd.py",
    "FedLC": "serverlc.py",
    "FedMTL": "servermtl.py",
    "FedNTD": "serverntd.py",
    "FedPAC": "serverpac.py",
    "FedPCL": "serverpcl.py",
    "FedPHP": "serverphp.py",
    "FedPer": "serverper.py",
    "FedProto": "serverproto.py",
    "FedProx": "serverprox.py",
    "FedRep": "serverrep.py",
    "FedRoD": "serverrod.py",
    "GPFL": "servergpfl.py",
    "LG-FedAvg": "serverlg.py",
    "Local": "serverlocal.py",
    "MOON": "servermoon.py",
    "Per-FedAvg": "serverperavg.py",
    "SCAFFOLD": "serverscaffold.py",
    "pFedMe": "serverpFedMe.py",
}

# FL-bench (github.com/KarhouTam/FL-bench), src/server/*.py at commit
# 06e658bca5af6ce732e25bb7c0f8be321e14a85e (2025-10-09).
FL_BENCH_COMMIT = "06e658bca5af6ce732e25bb7c0f8be321e14a85e"
FL_BENCH: dict[str, str] = {
    "ADCOL": "adcol.py",
    "APFL": "apfl.py",
    "CCVR": "ccvr.py",
    "CFL": "cfl.py",
    "Ditto": "ditto.py",
    "Elastic": "elastic.py",
    "FLUTE": "flute.py",
    "FedADMM": "fedadmm.py",
    "FedAH": "fedah.py",
    "FedALA": "fedala.py",
    "FedAP": "fedap.py",
    "FedAS": "fedas.py",
    "FedAvg": "fedavg.py",
    "FedAvgM": "fedavgm.py",
    "FedBABU": "fedbabu.py",
    "FedBN": "fedbn.py",
    "FedDyn": "feddyn.py",
    "FedEM": "fedem.py",
    "FedFed": "fedfed.py",
    "FedFomo": "fedfomo.py",
    "FedGen": "fedgen.py",
    "FedIIR": "fediir.py",
    "FedLC": "fedlc.py",
    "FedMD": "fedmd.py",
    "FedOpt": "fedopt.py",
    "FedPAC": "fedpac.py",
    "FedPer": "fedper.py",
    "FedProto": "fedproto.py",
    "FedProx": "fedprox.py",
    "FedRep": "fedrep.py",
    "FedRoD": "fedrod.py",
    "FedSR": "fedsr.py",
    "Floco": "floco.py",
    "LG-FedAvg": "lgfedavg.py",
    "Local": "local.py",
    "MOON": "moon.py",
    "MetaFed": "metafed.py",
    "PeFLL": "pefll.py",
    "Per-FedAvg": "perfedavg.py",
    "SCAFFOLD": "scaffold.py",
    "kNN-Per": "knnper.py",
    "pFedFDA": "pfedfda.py",
    "pFedHN": "pfedhn.py",
    "pFedLA": "pfedla.py",
    "pFedMe": "pfedme.py",
    "pFedSim": "pfedsim.py",
}

# What fedbench has outside the algorithm registry, the server optimizers (`server_opt=`,
# fedbench/algorithms/_server.py): (option, method, paper, PFLlib name, FL-bench name).
SERVER_OPTIMIZERS: tuple[tuple[str, str, str, str | None, str | None], ...] = (
    ("server_opt=sgd", "FedAvgM", "Hsu, Qi, Brown, 2019 (arXiv:1909.06335)", None, "FedAvgM"),
    (
        "server_opt=adagrad|adam|yogi",
        "FedAdagrad, FedAdam, FedYogi",
        "Reddi et al., ICLR 2021",
        None,
        "FedOpt",
    ),
)
