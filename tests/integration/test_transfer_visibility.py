"""The transfer library exports only include/disagg/transfer.h: it is built
with -fvisibility=hidden, so every other symbol (registry_*, tcp_client_*,
the transports' tables, rdma_*) is hidden.  Read from the static library
next to the disagg binary with readelf."""
import os
import re
import shutil
import subprocess

import pytest

pytestmark = pytest.mark.timeout(60)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def symbols(lib):
    out = subprocess.run(["readelf", "-sW", lib], check=True, capture_output=True, text=True).stdout
    syms = {}
    for line in out.splitlines():
        f = line.split()
        # Num: Value Size Type Bind Vis Ndx Name
        if len(f) >= 8 and f[4] == "GLOBAL" and f[6] != "UND":
            syms[f[7]] = f[5]
    return syms


def header_functions():
    text = open(os.path.join(ROOT, "include/disagg/transfer.h")).read()
    return set(re.findall(r"\b(transfer_[a-z_]+)\s*\(", text))


def test_only_transfer_h_is_exported(disagg_bin):
    lib = os.path.join(os.path.dirname(disagg_bin), "libdisagg_transfer.a")
    if not os.path.exists(lib) or not shutil.which("readelf"):
        pytest.skip("needs the build tree's libdisagg_transfer.a and readelf")
    syms = symbols(lib)
    exported = {s for s, vis in syms.items() if vis == "DEFAULT"}
    declared = header_functions()
    assert exported, "no exported symbols found"
    assert exported <= declared, f"exported but not in transfer.h: {sorted(exported - declared)}"
    missing = declared - exported
    assert not missing, f"declared in transfer.h but not defined: {sorted(missing)}"
    for internal in ["registry_add", "tcp_client_create", "segment_desc_decode",
                     "handshake_fetch", "tcp_transport_create", "shm_transport_create",
                     "rdma_transport_create", "stager_create"]:
        assert syms.get(internal) == "HIDDEN", f"{internal}: {syms.get(internal)}"
