#!/usr/bin/env bash
# Issue 36's GPU check, on a lent NVIDIA machine (H200, sm_90; Python 3.12; no network), in about
# 8 minutes: MLX's CUDA build from an offline bundle, batchsim from this working tree, then, each
# under a hard time limit and whatever the others did, with everything written to $OUT:
#   1. roofline --dtypes float16,q4,q8 --json          (float and quantized ceilings)
#   2. the backend-sensitive tests (token equality, quantized dtypes, roofline/calibrate rates)
#   3. calibrate --quick                                (a profile of this GPU, ~3 min)
#   4. validate of 4 closed/burst cases against it      (simulated vs real)
# and $OUT/summary.json with each step's exit status and seconds and the numbers that matter.
#
# Before (here, once; .gpu/ is ignored by git, ~29 MB):
#   bash /work/shared/tools/mlx-cuda-bundle.sh .gpu        # mlx + mlx-cuda-13 for sm_90, mlx-lm
#   scripts/gpu_check.sh --wheels                          # + small wheels a bare Python may lack
# Then, from the session that holds the device:
#   run(command="bash scripts/gpu_check.sh", carry=[".gpu"], timeout_s=540)
# The machine must have numpy, matplotlib, jinja2 and transformers >= 5.7 (mlx-lm's tokenizers),
# and NVIDIA's cu13 libraries as Python packages (`import nvidia`); the script reports each.
# BATCHSIM_GPU_DRYRUN=1: no install, this machine's .venv, CPU-sized steps: checks the logic here.
# BATCHSIM_GPU_LIMITS="roofline=75 tests=150 calibrate=170 validate=75" sets the limits (seconds,
# these defaults: about 8 minutes with the install);
# BATCHSIM_GPU_STEPS="roofline tests" runs only those; BATCHSIM_GPU_PYTHON: the Python (python3).
set -uo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
OUT=${OUT:-/tmp/gpu-check-out}
mkdir -p "$OUT/results"
bundle=$repo/.gpu
dry=${BATCHSIM_GPU_DRYRUN:-}
declare -A limit=([roofline]=75 [tests]=150 [calibrate]=170 [validate]=75)
for kv in ${BATCHSIM_GPU_LIMITS:-}; do limit[${kv%%=*}]=${kv#*=}; done
steps=" ${BATCHSIM_GPU_STEPS-roofline tests calibrate validate} "
say() { echo "gpu_check: $*" | tee -a "$OUT/gpu_check.log" >&2; }

# Wheels for what a bare Python 3.12 may lack (pure Python or cp312 manylinux): pip import name ->
# the wheels that provide it with its dependencies.
declare -A wheels=(
  [yaml]="pyyaml" [rich]="rich markdown_it_py mdurl pygments"
  [aiohttp]="aiohttp aiohappyeyeballs aiosignal attrs frozenlist multidict propcache yarl idna
             typing_extensions"
  [pytest]="pytest pluggy iniconfig packaging" [pytest_timeout]="pytest_timeout"
  [hypothesis]="hypothesis sortedcontainers attrs"
)
if [ "${1:-}" = --wheels ]; then  # run here: fetch them into .gpu/whl
  plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
        --platform manylinux2014_x86_64)
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${plat[@]}" -d "$bundle/whl" \
    $(printf '%s\n' ${wheels[@]} | sort -u | tr _ -)
  du -sh "$bundle"; exit 0
fi

install() {
  local site=/tmp/bsim-site py=${BATCHSIM_GPU_PYTHON:-python3}
  say "installing into $site from $bundle"
  local tarball=$bundle/mlx-cuda-sm90.tar.xz
  [ -f "$tarball" ] || { say "no $tarball: carry .gpu (see the header)"; return 1; }
  $py -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' \
    || say "warning: $($py -V), the bundle is for 3.12"
  rm -rf "$site" && mkdir -p "$site" && tar xJf "$tarball" -C "$site" || return 1
  export PYTHONPATH=$site
  local need=("$bundle"/whl/mlx_lm-*.whl "$bundle"/whl/asyncio_throttle-*.whl)
  for mod in "${!wheels[@]}"; do
    if ! $py -c "import $mod" 2>/dev/null; then
      say "missing $mod: installing ${wheels[$mod]}"
      for w in ${wheels[$mod]}; do need+=("$bundle"/whl/"$w"-*.whl); done
    fi
  done
  local whls
  whls=$(printf '%s\n' "${need[@]}" | sort -u)
  if ! $py -m pip install -q --no-index --no-deps --target "$site" $whls \
       >>"$OUT/gpu_check.log" 2>&1; then
    say "pip could not install the wheels (see gpu_check.log): unzipping them into $site"
    for w in $whls; do $py -m zipfile -e "$w" "$site" || say "could not unzip $w"; done
  fi
  for mod in numpy matplotlib jinja2 transformers sentencepiece google.protobuf; do
    $py -c "import $mod" 2>/dev/null || say "missing $mod (not in the bundle): steps needing it fail"
  done
  local nv
  nv=$($py -c 'import nvidia; print(list(nvidia.__path__)[0])' 2>/dev/null) \
    && ln -sfn "$nv" "$site/nvidia" \
    || say "no NVIDIA Python libraries (import nvidia): MLX CUDA may not load"
  LD_LIBRARY_PATH=$(find -L "$site/nvidia/" -name 'lib*.so*' -printf '%h\n' 2>/dev/null \
                    | sort -u | paste -sd:)
  export LD_LIBRARY_PATH
  ln -sfn "$repo" "$site/batchsim"  # the checkout is the batchsim package (pyproject: package-dir)
  PY=$py
}

step() {  # step NAME CMD...: run under limit[NAME], stdout/stderr to $OUT/NAME.{out,err}
  local name=$1; shift
  local t0=$SECONDS rc
  [[ $steps == *" $name "* ]] || return 0
  say "$name: up to ${limit[$name]} s: $*"
  timeout -k 10 "${limit[$name]}" "$@" >"$OUT/$name.out" 2>"$OUT/$name.err"; rc=$?
  say "$name: exit $rc after $((SECONDS - t0)) s$([ $rc = 124 ] && echo ' (time limit)')"
  printf '{"step": "%s", "rc": %d, "seconds": %d, "limit_s": %d}\n' "$name" "$rc" \
    $((SECONDS - t0)) "${limit[$name]}" >>"$OUT/steps.jsonl"
  [ $rc = 0 ] || tail -n 15 "$OUT/$name.err" >&2
}

rm -f "$OUT/steps.jsonl"
if [ -n "$dry" ]; then
  say "dry run: no install, $repo/.venv, the CPU backend"
  PY=$repo/.venv/bin/python
  roofline=(--n 256,512 --dtypes float32,q4,q8 --sweep-n 256 --bandwidth-mb 32 --reps 3
            --max-seconds-per-point 1)
  tests=(-k "invariance or quantized_kv_batched or quantized_run or measure_rates")
  calibrate=(--models tiny --batches 1,4 --widths 128 --chunks 16,64 --starts 0)
  validate=(--model smollm2-135m --cases b32-burst)
else
  install || { say "install failed"; exit 1; }
  roofline=(--dtypes float16,q4,q8 --max-seconds-per-point 5)
  tests=()
  calibrate=()
  validate=(--cases b32-burst,b16-closed-8,b8-tight-queue,b16-tight-preempt)
fi
export BATCHSIM_HOME=/tmp/bsim-home MPLBACKEND=Agg
export BATCHSIM_TEST_DIVERGENCE_LOG=$OUT/divergences.jsonl
bs=("$PY" -m batchsim.scripts.cli)
"$PY" - >"$OUT/env.json" 2>>"$OUT/gpu_check.log" <<'PY'
import json
from importlib import metadata
from batchsim.server.platform import blas, env
blas.preload()
import mlx.core as mx
names = {(d.metadata["Name"] or "").lower() for d in metadata.distributions()}
versions = {p: metadata.version(p) if p in names else None
            for p in ("mlx", "mlx-cuda-13", "mlx-lm", "transformers", "numpy", "matplotlib")}
print(json.dumps({"backend": env.backend(), "device": str(mx.default_device()),
                  "device_info": {k: str(v) for k, v in mx.device_info().items()}, **versions}))
PY
say "environment: $(cat "$OUT/env.json" 2>/dev/null || echo 'MLX did not load, see gpu_check.log')"

step roofline "${bs[@]}" roofline "${roofline[@]}" --json --out "$OUT/results"
step tests "$PY" -m pytest -q -rfE -p no:cacheprovider -o timeout=150 --junitxml="$OUT/tests.xml" \
  tests/test_backend_invariance.py tests/test_mlx_executor.py tests/test_family_executor.py \
  tests/test_kv_quant.py tests/test_roofline.py tests/test_quantized_rates.py "${tests[@]}"
step calibrate "${bs[@]}" calibrate --quick "${calibrate[@]}" --name gpu-check \
  --profile-out "$OUT/gpu-check.yaml" --out "$OUT/results"
[ -f "$OUT/gpu-check.yaml" ] || { say "no profile from calibrate: validate skipped"; steps=${steps/ validate / }; }
step validate "${bs[@]}" validate --device-profile "$OUT/gpu-check.yaml" --repeats 1 \
  "${validate[@]}" --out "$OUT/results" --json
find "$OUT/results" -name '*.jsonl' -size +2M -delete  # validate's per-request records, if large
"$PY" - "$OUT" >"$OUT/summary.json" <<'PY' || say "summary failed"
import json, sys, xml.etree.ElementTree as ET
from pathlib import Path

out = Path(sys.argv[1])
def last_json(name):
    try:
        return json.loads((out / name).read_text().strip().splitlines()[-1])
    except Exception as exc:
        return {"error": f"{name}: {type(exc).__name__}: {exc}"[:300]}
def jsonl(name):
    p = out / name
    lines = p.read_text().splitlines() if p.exists() else []
    return [json.loads(line) for line in lines if line.strip()]
doc = {"steps": jsonl("steps.jsonl"), "env": last_json("env.json")}
r = last_json("roofline.out")
keys = ("dtype", "shape", "n", "batch", "gflops", "gbytes_s", "bound", "act_dtype")
pick = lambda row: {k: row.get(k) for k in keys}
doc["roofline"] = {"bandwidth_gbs": r.get("bandwidth_gbs"), "peak_gflops": r.get("peak_gflops"),
                   "rows": [pick(x) for x in r.get("rows", [])],
                   "sweep": [pick(x) for x in r.get("sweep", {}).get("rows", [])],
                   "compute_bound_from_batch": r.get("sweep", {}).get("compute_bound_from_batch"),
                   "error": r.get("error")}
try:
    suite = ET.parse(out / "tests.xml").getroot()
    suite = suite if suite.tag == "testsuite" else suite[0]
    failed = [{"test": f"{c.get('classname')}::{c.get('name')}",
               "message": (bad.get("message") or "")[:400]}
              for c in suite.iter("testcase") for bad in c if bad.tag in ("failure", "error")]
    doc["tests"] = {k: suite.get(k) for k in ("tests", "failures", "errors", "skipped", "time")}
    doc["tests"]["failed"] = failed
except Exception as exc:
    doc["tests"] = {"error": str(exc)[:300]}
div = jsonl("divergences.jsonl")
doc["divergences"] = {"near_ties": [d for d in div if d.get("kind") == "near_tie"],
                      "batched_vs_single": [d for d in div if d.get("kind") == "batched_vs_single"]}
try:
    import yaml
    prof = yaml.safe_load((out / "gpu-check.yaml").read_text())
    doc["profile"] = {k: prof.get(k) for k in ("bandwidth_gbs", "peak_tflops", "quantized_gemv_gbs",
                                               "quantized_gemm_gflops", "source")}
except Exception as exc:
    doc["profile"] = {"error": str(exc)[:300]}
cal = jsonl("results/calibrate.jsonl")
if cal:
    doc["calibrate"] = {k: cal[-1].get(k) for k in ("median_abs_err", "max_abs_err", "held_out",
                                                    "transfer_err", "elapsed_s")}
v = last_json("validate.out")
doc["validate"] = {k: v.get(k) for k in ("model", "median_abs_err", "max_abs_err", "worst_case",
                                         "noise_floor", "step_time_err", "error") if k in v}
doc["validate"]["cases"] = {c.get("case"): c.get("error") for c in v.get("cases", [])}
print(json.dumps(doc, indent=1, default=str))
PY
cat "$OUT/summary.json"
