#!/usr/bin/env bash
# device_check: plexserve on one GPU, within 8 minutes.
#
#   bash benchmarks/device_check.sh            # on a machine with a GPU
#   bash benchmarks/device_check.sh --dry-run  # anywhere, in seconds: checks the plan (CI runs this)
#
# Steps, each with its own time limit (together 8 minutes at most):
#   cuda-tests       pytest -m cuda (the tests that need a GPU; each skips cleanly without one)
#   serve_e2e        benchmarks/serve_e2e.py --quick --device cuda (fast ingress, short texts, 1 and 16 clients, no overload, no soak)
#   parallel_runtime benchmarks/parallel_runtime.py --quick --device cuda
#   many_models      benchmarks/many_models.py --sim-only --quick (the live comparison is not built yet)
# Each step's stdout (a benchmark's final JSON line) goes to <out>/<step>.out, its stderr to <out>/<step>.err, and
# <out>/summary.txt holds one line per step: its name, exit status and seconds. <out> is $OUT when set (the device
# tool's output folder), else benchmarks/out/device_check/. The exit status is 0 when every step passed.
#
# --dry-run runs nothing on a GPU: it checks that every command exists and accepts its arguments (each benchmark's
# --help, which lists every flag the plan passes; pytest's collection of the CUDA tests), prints the plan, exits 0.
# Environment: PYTHON (default .venv/bin/python, else python3).
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 2
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export RAY_AUTH_MODE="${RAY_AUTH_MODE:-disabled}" RAY_USAGE_STATS_ENABLED=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

DRY_RUN=0
case "${1:-}" in
    --dry-run) DRY_RUN=1 ;;
    "") ;;
    -h|--help) sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "device_check: unknown argument '$1' (use --dry-run or nothing)" >&2; exit 2 ;;
esac

OUT_DIR="${OUT:-$ROOT/benchmarks/out/device_check}"

# name | seconds allowed | command (arguments split on spaces)
STEPS=(
    "cuda-tests|90|$PYTHON -m pytest -q -m cuda tests"
    "serve_e2e|150|$PYTHON benchmarks/serve_e2e.py --quick --device cuda --ingress fast_ingress --clients 1 16 --skip-overload --mixes short --soak-s 0 --skip-infinity"
    "parallel_runtime|120|$PYTHON benchmarks/parallel_runtime.py --quick --device cuda"
)
if [[ -f benchmarks/many_models.py ]]; then
    STEPS+=("many_models|120|$PYTHON benchmarks/many_models.py --sim-only --quick")
fi

check_step() {  # name, command: does it exist and accept its arguments?
    local name="$1"; shift
    local -a cmd=("$@")
    if ! command -v "${cmd[0]}" >/dev/null 2>&1; then
        echo "device_check: $name: ${cmd[0]} not found" >&2; return 1
    fi
    if [[ "$name" == "cuda-tests" ]]; then
        local collected
        if ! collected="$("${cmd[@]}" --collect-only 2>&1)"; then
            echo "device_check: $name: pytest cannot collect the CUDA tests:" >&2; echo "$collected" >&2; return 1
        fi
        echo "check: $name: $(grep -c '::' <<<"$collected") CUDA test(s) collected"
        return 0
    fi
    local script="${cmd[1]}" help flag
    if [[ ! -f "$script" ]]; then echo "device_check: $name: $script does not exist" >&2; return 1; fi
    if ! help="$("${cmd[@]}" --help 2>&1)"; then
        echo "device_check: $name: $script refuses its arguments:" >&2; echo "$help" >&2; return 1
    fi
    for flag in "${cmd[@]:2}"; do
        if [[ "$flag" == --* ]] && ! grep -q -- "$flag" <<<"$help"; then
            echo "device_check: $name: $script has no $flag option" >&2; return 1
        fi
    done
    echo "check: $name: $script accepts ${cmd[*]:2}"
}

if [[ ! -f benchmarks/many_models.py ]]; then
    echo "plan: many_models: skipped (no benchmarks/many_models.py)"
fi
total=0
for step in "${STEPS[@]}"; do
    IFS='|' read -r name limit command <<<"$step"
    total=$((total + limit))
    echo "plan: $name (at most ${limit} s): $command > $OUT_DIR/$name.out"
done
echo "plan: at most ${total} s in all; outputs under $OUT_DIR"
if (( total > 480 )); then echo "device_check: the plan's limits exceed 8 minutes (${total} s)" >&2; exit 1; fi

if (( DRY_RUN )); then
    failed=0
    for step in "${STEPS[@]}"; do
        IFS='|' read -r name limit command <<<"$step"
        read -r -a cmd <<<"$command"
        check_step "$name" "${cmd[@]}" || failed=1
    done
    if (( failed )); then echo "dry run: the plan does not hold" >&2; exit 1; fi
    echo "dry run: every step's command exists and accepts its arguments"
    exit 0
fi

if ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "device_check: torch sees no GPU here; run with --dry-run to check the plan only" >&2
    exit 2
fi
mkdir -p "$OUT_DIR"
: >"$OUT_DIR/summary.txt"
status=0
for step in "${STEPS[@]}"; do
    IFS='|' read -r name limit command <<<"$step"
    read -r -a cmd <<<"$command"
    echo "device_check: $name (at most ${limit} s)" >&2
    started=$SECONDS
    timeout --kill-after=10 "$limit" "${cmd[@]}" >"$OUT_DIR/$name.out" 2>"$OUT_DIR/$name.err"
    rc=$?
    echo "$name rc=$rc seconds=$((SECONDS - started))" | tee -a "$OUT_DIR/summary.txt"
    (( rc == 0 )) || status=1
done
exit "$status"
