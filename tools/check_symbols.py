#!/usr/bin/env python3
"""The exported-symbol check (docs/architecture.md, "Exported symbols"): every global symbol a
library defines is declared in one of that library's headers and carries one of its modules'
prefixes.

usage: tools/check_symbols.py BUILD_DIR      (the ctest `symbols` passes CMake's build dir)

Each static library BUILD_DIR/libdisagg_X.a is the layer src/X/ (include/disagg/transfer.h
belongs to transfer).  One `nm` over all of them lists the global defined symbols; for each:

* declared: the name is an identifier of a header (.h) under src/X/ -- otherwise it is used
  by no other file and should be `static`, or a header was forgotten;
* prefixed: the name starts with a module prefix of its library: NAME_ and NAME's first
  word for every header NAME.h under src/X/ (base/flags.h: `flags_`; transfer/tcp_client.h:
  `tcp_client_`, `tcp_`), or a prefix of the table PREFIXES below (the modules whose short
  prefix is not their file's name, base/http_server.h's `hs_`, and the modules without a
  header of their own);
* one owner: no symbol is defined by two libraries.

Exceptions live in tools/symbols_allow.txt (a symbol, then why, one a line); an entry that is
no longer needed fails the check too, so the list shows what is left to rename.  Exits 1
naming each offender (its source file and library, what is wrong and how to fix it)."""
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ALLOW = ROOT / "tools" / "symbols_allow.txt"

# Module prefixes that are not a header's file name, per library (layer).
PREFIXES = {
    "base": ["hs_", "hc_", "flag_", "uuid4"],  # http_server.h, http_client.h, flags.h, uuid.h
    "transfer": ["stage_", "stager_"],         # staging.h: the stager and its stage pairs
    "kernels": [],
    "model": ["st_", "tok_"],                  # safetensors.h, tokenizer_int.h
    # grammar_ir.h: the IR (gir_) and the front ends regex.c and json_schema.c
    "grammar": ["gir_", "regex_", "json_schema_"],
    "engine": ["sched_"],                      # scheduler.h
    "connector": ["mc_"],                      # mooncake_internal.h
    "server": ["oai_", "prep_"],               # openai_request/response.h; prep.c (server_ctx.h)
    "proxy": ["relay_"],                       # relay.c (proxy_internal.h)
}

# Extra headers of a library outside src/X/.
EXTRA_HEADERS = {"transfer": [ROOT / "include" / "disagg" / "transfer.h"]}

COMMENT = re.compile(r"/\*.*?\*/|//[^\n]*", re.S)
IDENT = re.compile(r"\b[A-Za-z_]\w*\b")


def headers_of(layer):
    hs = sorted((ROOT / "src" / layer).rglob("*.h")) + EXTRA_HEADERS.get(layer, [])
    names = {}
    for h in hs:
        for w in IDENT.findall(COMMENT.sub(" ", h.read_text(errors="replace"))):
            names.setdefault(w, h)
    return hs, names


def read_allow():
    allow = {}
    if not ALLOW.exists():
        return allow
    for ln, line in enumerate(ALLOW.read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        sym, _, why = line.partition(" ")
        if not why.strip():
            sys.exit(f"check_symbols: {ALLOW.relative_to(ROOT)}:{ln}: '{sym}' needs a reason after it")
        allow[sym] = (ln, why.strip())
    return allow


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    build = Path(sys.argv[1])
    libs = sorted(build.glob("libdisagg_*.a"))
    if not libs:
        sys.exit(f"check_symbols: no libdisagg_*.a in {build} (build first)")
    out = subprocess.run(["nm", "-A", "-P", "-g", "--defined-only", *map(str, libs)],
                         check=True, capture_output=True, text=True).stdout
    # "BUILD/libdisagg_base.a[log.c.o]: log_msg T 1f0 2a"
    syms = []
    for line in out.splitlines():
        m = re.match(r"(.*)/libdisagg_(\w+)\.a\[(.+?)\.o\]: (\S+) ([A-Za-z])", line)
        # names starting with "__" are the implementation's (gcc's ASan: __odr_asan.NAME)
        if m and m.group(5) not in "UwvN" and not m.group(4).startswith("__"):
            syms.append((m.group(2), m.group(3), m.group(4)))

    allow = read_allow()
    layers = sorted({s[0] for s in syms})
    info, sources = {}, {}
    for layer in layers:
        if not (ROOT / "src" / layer).is_dir():
            sys.exit(f"check_symbols: libdisagg_{layer}.a has no src/{layer}/ (a new library? "
                     f"add it to this script's PREFIXES)")
        hs, names = headers_of(layer)
        for f in (ROOT / "src" / layer).rglob("*.c"):
            sources[(layer, f.name)] = str(f.relative_to(ROOT))
        prefixes = sorted({h.stem + "_" for h in hs} | {h.stem.split("_")[0] + "_" for h in hs}
                          | set(PREFIXES.get(layer, [])))
        info[layer] = (names, prefixes)

    owner = {}
    bad, allowed_used = [], set()
    for layer, obj, sym in syms:
        names, prefixes = info[layer]
        where = f"{sources.get((layer, obj), obj)} (libdisagg_{layer}.a)"
        problems = []
        if sym in owner and owner[sym] != layer:
            problems.append(f"also defined by libdisagg_{owner[sym]}.a: one of them renames it")
        owner.setdefault(sym, layer)
        if sym not in names:
            problems.append(f"declared in no header of src/{layer}/: make it static in {obj}, "
                            f"or declare it in its module's header")
        if not any(sym.startswith(p) for p in prefixes):
            stem = Path(obj).stem
            hint = stem + "_" if stem + "_" in prefixes else None
            problems.append(
                f"lacks a module prefix of {layer}/ ({', '.join(prefixes)}): rename it"
                + (f", e.g. {hint}{sym}" if hint else "") + " (or make it static)")
        if not problems:
            continue
        if sym in allow:
            allowed_used.add(sym)
            continue
        for p in problems:
            bad.append(f"{sym}: {where}: {p}")

    defined = {s[2] for s in syms}
    for sym, (ln, why) in sorted(allow.items(), key=lambda kv: kv[1][0]):
        if sym in defined and sym not in allowed_used:
            bad.append(f"{ALLOW.relative_to(ROOT)}:{ln}: '{sym}' passes the check now: remove "
                       f"its line")
    for b in bad:
        print("check_symbols:", b, file=sys.stderr)
    print(f"check_symbols: {len(libs)} libraries, {len(syms)} global symbols, "
          f"{len(allowed_used)} allowed by {ALLOW.relative_to(ROOT)}, {len(bad)} offenders")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
