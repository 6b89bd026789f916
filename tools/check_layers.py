#!/usr/bin/env python3
"""The layering check (docs/architecture.md): a lower layer never includes a higher one.

Reads the "Layers and modules" table of docs/architecture.md -- its first column names
each layer (a folder of src/), its last column what that layer may depend on -- and
checks every `#include "..."` of every file under src/ against it.  An include resolves
as the compiler resolves it (beside the file, then src/, then include/); a file may
include its own layer, the layers its row names, and (for a sub-layer such as
kernels/cpu/) the layer it is part of -- see allowed_layers for the exact rule.
include/disagg/transfer.h counts as the transfer layer.
Exits 1 naming each violation (file:line, the include, the two layers)."""
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def read_table(doc):
    rows = []
    in_table = False
    for line in doc.read_text().splitlines():
        if line.startswith("## Layers and modules"):
            in_table = True
            continue
        if in_table and line.startswith("## "):
            break
        m = re.match(r"\|\s*`([a-z_/]+)/`\s*\|.*\|\s*([^|]*)\|\s*$", line)
        if in_table and m:
            rows.append((m.group(1), m.group(2).strip()))
    if not rows:
        sys.exit(f"check_layers: no layer table under '## Layers and modules' in {doc}")
    return rows


def allowed_layers(rows):
    """Order rule: a layer includes itself and the layers after it in the table; a row
    whose dependencies say "only" includes just those it names.  Sub-layers (kernels/cpu/)
    are private to their parent: nothing else, not even a sibling, includes them."""
    names = [r[0] for r in rows]
    subs = {n for n in names if "/" in n}
    allowed = {}
    for i, (layer, deps) in enumerate(rows):
        parent = layer.rsplit("/", 1)[0] if "/" in layer else None
        if re.search(r"\bonly\b", deps):
            ok = {w for w in re.findall(r"[a-z_/]+", deps) if w in names}
        else:
            below = names[i + 1:]
            if parent:  # a sub-layer sits beside its siblings: below means below the parent's group
                below = [n for n in names[names.index(parent) + 1:] if not n.startswith(parent + "/")]
            ok = set(below)
        ok = {n for n in ok if n not in subs or n.rsplit("/", 1)[0] == layer}
        ok |= {n for n in subs if n.rsplit("/", 1)[0] == layer}  # a parent owns its sub-layers
        if parent:
            ok.add(parent)
        ok.add(layer)
        allowed[layer] = ok
    return allowed


def layer_of(path, names):
    """The deepest layer folder that holds path (src/kernels/cpu/x.c -> kernels/cpu)."""
    if path.is_relative_to(ROOT / "include" / "disagg"):
        return "transfer"  # include/disagg/transfer.h: the transfer layer's public header
    try:
        rel = path.relative_to(ROOT / "src")
    except ValueError:
        return None  # bench/ and other folders above src/ (the cli layer's)
    best = None
    for n in names:
        if rel.parts[:len(n.split("/"))] == tuple(n.split("/")) and (not best or len(n) > len(best)):
            best = n
    return best


def resolve(src_file, inc):
    for base in (src_file.parent, ROOT / "src", ROOT / "include", ROOT):
        p = (base / inc).resolve()
        if p.is_file():
            return p
    return None


def main():
    rows = read_table(ROOT / "docs" / "architecture.md")
    names = [r[0] for r in rows]
    allowed = allowed_layers(rows)
    bad = []
    n_files = n_incs = 0
    for f in sorted((ROOT / "src").rglob("*")):
        if f.suffix not in (".c", ".h", ".cu", ".cuh"):
            continue
        n_files += 1
        me = layer_of(f, names)
        if me is None:
            bad.append(f"{f.relative_to(ROOT)}: in no layer of docs/architecture.md's table")
            continue
        for ln, line in enumerate(f.read_text(errors="replace").splitlines(), 1):
            m = re.match(r'\s*#\s*include\s+"([^"]+)"', line)
            if not m:
                continue
            n_incs += 1
            target = resolve(f, m.group(1))
            if target is None:
                bad.append(f"{f.relative_to(ROOT)}:{ln}: #include \"{m.group(1)}\" resolves to no file")
                continue
            them = layer_of(target, names)
            if them is None or them == me:
                continue
            if them not in allowed[me]:
                bad.append(f"{f.relative_to(ROOT)}:{ln}: #include \"{m.group(1)}\": layer {me}/ "
                           f"may not include {them}/ (allowed: {', '.join(sorted(allowed[me] - {me}))})")
    for b in bad:
        print("check_layers:", b, file=sys.stderr)
    print(f"check_layers: {n_files} files, {n_incs} includes, {len(bad)} violations")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
