#!/usr/bin/env bash
# Build the offline wheel bundle for the GPU image (Python 3.12, x86_64, no internet).
#
#   bash scripts/build_offline_bundle.sh            # -> .whl/
#   bash scripts/build_offline_bundle.sh /tmp/wh     # -> /tmp/wh
#   NEMO_SSA_BUNDLE_BUDGET_MIB=64 bash scripts/build_offline_bundle.sh
#
# Needs: python3 with pip, and PyPI. What it does:
#   1. binary wheels for cp312 manylinux x86_64 (or pure-python wheels) of every pin in
#      requirements/gpu-bundle.txt, with --no-deps (the list is the whole closure);
#   2. `pip wheel --no-deps` for the pins that PyPI has only as an sdist (pure python:
#      antlr4-python3-runtime 4.9.3, wget 3.2);
#   3. a wheel of this repository (nemo_ssa, recipes);
#   4. nemo_ssa_offline_stubs-*.whl: the import-only stubs of nemo_ssa/_offline_stubs/
#      (today only `pulp`, standing in for the 16 MiB PuLP; see that package's docstring)
#      as top-level modules, so that installing the bundle activates them;
#   5. checks: one wheel per pinned name, every wheel's tag runs on cp312 manylinux
#      x86_64, and the total stays under the budget (default 60 MiB; the device machine
#      takes at most 64 MiB of tree + wheels). Prints a per-wheel size table.
# The output directory is emptied of *.whl first, so it holds exactly one bundle.
# Install on the GPU node: see docs/offline-bundle.md (one line, --no-index --no-deps).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="${1:-$root/.whl}"
list="${NEMO_SSA_BUNDLE_LIST:-$root/requirements/gpu-bundle.txt}"
budget_mib="${NEMO_SSA_BUNDLE_BUDGET_MIB:-60}"
py="${PYTHON:-python3}"

# Pins that PyPI has only as a source distribution (all pure python): built locally.
sdist_only=("antlr4-python3-runtime" "wget")

mkdir -p "$out"
out="$(cd "$out" && pwd)"
rm -f "$out"/*.whl
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

# name==version lines, comments and blanks dropped
mapfile -t pins < <(sed -e 's/#.*//' -e 's/[[:space:]]//g' "$list" | grep -v '^$')
[ "${#pins[@]}" -gt 0 ] || { echo "[bundle] no pins in $list" >&2; exit 1; }

binary=()
source=()
for pin in "${pins[@]}"; do
    case "$pin" in *==*) ;; *) echo "[bundle] not pinned with ==: $pin" >&2; exit 1 ;; esac
    name="${pin%%==*}"
    norm="$(echo "$name" | tr 'A-Z_.' 'a-z--')"
    is_sdist=0
    for s in "${sdist_only[@]}"; do [ "$norm" = "$s" ] && is_sdist=1; done
    if [ "$is_sdist" = 1 ]; then source+=("$pin"); else binary+=("$pin"); fi
done

pipq=("$py" -m pip --disable-pip-version-check)
# pip, minus the noise of pip.conf's partial local mirrors ("WARNING: Location ... ignored")
pip_() { "${pipq[@]}" "$@" 2> >(grep -v '^WARNING: Location' >&2); }

echo "[bundle] ${#binary[@]} binary/pure wheels from PyPI for cp312 manylinux x86_64" >&2
pip_ download -q --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
    --platform manylinux_2_39_x86_64 --platform manylinux_2_35_x86_64 \
    --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64 \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any \
    -d "$out" "${binary[@]}"

if [ "${#source[@]}" -gt 0 ]; then
    echo "[bundle] building pure-python wheels from sdists: ${source[*]}" >&2
    pip_ wheel -q --no-deps --no-binary=:all: -w "$work/sdist" "${source[@]}"
    for w in "$work"/sdist/*.whl; do
        case "$(basename "$w")" in
            *-py3-none-any.whl | *-py2.py3-none-any.whl) cp "$w" "$out"/ ;;
            *) echo "[bundle] sdist built a non-pure wheel (would not run on cp312): $w" >&2; exit 1 ;;
        esac
    done
fi

echo "[bundle] wheel of this repository ($root)" >&2
pip_ wheel -q --no-deps -w "$work/self" "$root"
cp "$work"/self/*.whl "$out"/

echo "[bundle] stub wheel from nemo_ssa/_offline_stubs" >&2
"$py" - "$root" "$out" <<'PY'
import base64, hashlib, pathlib, re, sys, zipfile

root, out = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
stubs = root / "nemo_ssa" / "_offline_stubs"
version = re.search(r'^version\s*=\s*"([^"]+)"', (root / "pyproject.toml").read_text(), re.M).group(1)
dist = "nemo_ssa_offline_stubs"
info = f"{dist}-{version}.dist-info"
files = {}
for pkg in sorted(p for p in stubs.iterdir() if p.is_dir() and (p / "__init__.py").exists()):
    for f in sorted(pkg.rglob("*.py")):
        files[f"{pkg.name}/{f.relative_to(pkg).as_posix()}"] = f.read_bytes()
files[f"{info}/METADATA"] = (
    f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n"
    "Summary: Import-only stubs (pulp) for the nemo_ssa offline GPU bundle; see "
    "docs/offline-bundle.md\n").encode()
files[f"{info}/WHEEL"] = (b"Wheel-Version: 1.0\nGenerator: nemo_ssa build_offline_bundle.sh\n"
                          b"Root-Is-Purelib: true\nTag: py3-none-any\n")
files[f"{info}/top_level.txt"] = "".join(
    sorted({k.split("/")[0] + "\n" for k in files if "/" in k and not k.startswith(info)})).encode()
record = []
for name, data in files.items():
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    record.append(f"{name},sha256={digest},{len(data)}")
record.append(f"{info}/RECORD,,")
files[f"{info}/RECORD"] = ("\n".join(record) + "\n").encode()
whl = out / f"{dist}-{version}-py3-none-any.whl"
with zipfile.ZipFile(whl, "w", zipfile.ZIP_DEFLATED) as z:
    for name, data in files.items():
        zi = zipfile.ZipInfo(name, date_time=(2020, 1, 1, 0, 0, 0))
        zi.external_attr = 0o644 << 16
        zi.compress_type = zipfile.ZIP_DEFLATED
        z.writestr(zi, data)
print(f"[bundle] wrote {whl.name}: {sorted(k for k in files if not k.startswith(info))}", file=sys.stderr)
PY

echo "[bundle] checking tags, duplicates, completeness and size" >&2
"$py" - "$out" "$list" "$budget_mib" <<'PY'
import pathlib, re, sys

out, listfile, budget_mib = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), float(sys.argv[3])
norm = lambda s: re.sub(r"[-_.]+", "-", s).lower()
pins = {}
for line in listfile.read_text().splitlines():
    line = line.split("#", 1)[0].strip()
    if line:
        name, ver = line.split("==")
        pins[norm(name)] = ver
extra = {"nemo-ssa", "nemo-ssa-offline-stubs"}

ok_py = {"py3", "py2.py3", "py312", "cp312"}
ok_abi = {"none", "abi3", "cp312"}
errors, seen, rows = [], {}, []
for whl in sorted(out.glob("*.whl")):
    parts = whl.name[:-4].split("-")
    if len(parts) not in (5, 6):
        errors.append(f"bad wheel name {whl.name}")
        continue
    name, ver, pyt, abi, plat = parts[0], parts[1], parts[-3], parts[-2], parts[-1]
    n = norm(name)
    seen.setdefault(n, []).append(whl.name)
    pys = set(pyt.split("."))
    if not (pys & ok_py or any(p.startswith("cp3") and abi == "abi3" and int(p[3:] or 0) <= 12 for p in pys)):
        errors.append(f"{whl.name}: python tag {pyt} does not run on CPython 3.12")
    if not set(abi.split(".")) & ok_abi:
        errors.append(f"{whl.name}: abi tag {abi} is not cp312/abi3/none")
    plats = plat.split(".")
    good_plat = any(p == "any" or (p.startswith("manylinux") and p.endswith("_x86_64")) for p in plats)
    if good_plat:
        for p in plats:
            m = re.match(r"manylinux_(\d+)_(\d+)_x86_64$", p)
            # the GPU image is Ubuntu 24.04 (glibc 2.39)
            if m and (int(m.group(1)), int(m.group(2))) > (2, 39):
                good_plat = False
    if not good_plat:
        errors.append(f"{whl.name}: platform {plat} is not manylinux x86_64 / any")
    if n in pins and pins[n] != ver and norm(ver) != norm(pins[n]):
        errors.append(f"{whl.name}: version {ver} != pinned {pins[n]}")
    rows.append((whl.stat().st_size, whl.name))
for n, names in seen.items():
    if len(names) > 1:
        errors.append(f"two wheels of {n}: {names} (pip install of the bundle would stop)")
missing = sorted(set(pins) - set(seen))
if missing:
    errors.append(f"no wheel for pinned: {missing}")
unexpected = sorted(set(seen) - set(pins) - extra)
if unexpected:
    errors.append(f"wheels not in {listfile.name}: {unexpected}")

total = sum(s for s, _ in rows)
mib = lambda b: b / 2**20
print(f"{'MiB':>8}  wheel")
for size, name in sorted(rows, reverse=True):
    print(f"{mib(size):8.2f}  {name}")
print(f"{mib(total):8.2f}  TOTAL ({len(rows)} wheels; budget {budget_mib:g} MiB) in {out}")
if total > budget_mib * 2**20:
    errors.append(f"bundle is {mib(total):.2f} MiB, over the {budget_mib:g} MiB budget")
if errors:
    print("[bundle] FAILED:", *errors, sep="\n  ", file=sys.stderr)
    sys.exit(1)
print("[bundle] OK", file=sys.stderr)
PY
