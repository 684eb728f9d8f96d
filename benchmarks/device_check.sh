#!/usr/bin/env bash
# device_check: plexserve on one GPU, within 8 minutes.
#
#   bash benchmarks/device_check.sh            # on a machine with a GPU
#   bash benchmarks/device_check.sh --dry-run  # anywhere, in seconds: checks the plan (CI runs this)
#   bash benchmarks/device_check.sh --steps serve_e2e,parallel_runtime   # only the steps named
#
# Steps, each with its own time limit (together 8 minutes at most):
#   cuda-tests       pytest -m cuda (the tests that need a GPU; each skips cleanly without one)
#   many_models      benchmarks/many_models.py --sim-only --quick, on the host's CPU beside cuda-tests (the live
#                    comparison's --quick run alone takes longer than this check's 8 minutes)
#   serve_e2e        benchmarks/serve_e2e.py --quick --device cuda (plexserve behind the fast ingress and the plain
#                    Serve app behind Serve's proxy, short texts, 1 and 16 clients, no overload, no soak)
#   parallel_runtime benchmarks/parallel_runtime.py --quick --device cuda
# Each step's stdout and stderr go to <out>/<step>.log (a benchmark's last line is its JSON figures),
# <out>/summary.txt holds one line per step (its name, exit status and seconds), <out>/env.json the GPU, driver and
# versions, and <out>/device_check.json the result record (also written to benchmarks/results/device_check.json).
# <out> is $OUT when set (the device tool's output folder), else benchmarks/out/device_check/. The exit status is 0
# when every step passed.
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
ONLY=""
while (( $# )); do
    case "$1" in
        --dry-run) DRY_RUN=1 ;;
        --steps)
            if [[ -z "${2:-}" ]]; then echo "device_check: --steps needs a comma-separated list of step names" >&2; exit 2; fi
            ONLY="$2"; shift ;;
        -h|--help) sed -n '2,23p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "device_check: unknown argument '$1' (use --dry-run, --steps NAMES or nothing)" >&2; exit 2 ;;
    esac
    shift
done

OUT_DIR="${OUT:-$ROOT/benchmarks/out/device_check}"

# name | seconds allowed | where | command (arguments split on spaces). `gpu` steps run one after another; `cpu`
# steps touch no GPU and run one after another in the background, beside the first `gpu` step, so the plan's time
# is max(first gpu step, cpu steps) + the other gpu steps.
STEPS=(
    "cuda-tests|80|gpu|$PYTHON -m pytest -q -m cuda tests"
    "serve_e2e|180|gpu|$PYTHON benchmarks/serve_e2e.py --quick --device cuda --clients 1 16 --skip-overload --mixes short --soak-s 0 --skip-infinity"
    "parallel_runtime|220|gpu|$PYTHON benchmarks/parallel_runtime.py --quick --device cuda"
)
if [[ -f benchmarks/many_models.py ]]; then
    STEPS+=("many_models|80|cpu|$PYTHON benchmarks/many_models.py --sim-only --quick")
fi
if [[ -n "$ONLY" ]]; then  # keep the steps named, in the plan's order; an unknown name is refused
    IFS=',' read -r -a wanted <<<"$ONLY"
    known=" "; for step in "${STEPS[@]}"; do known+="${step%%|*} "; done
    for name in "${wanted[@]}"; do
        if [[ "$known" != *" $name "* ]]; then
            echo "device_check: --steps: unknown step '$name' (steps:$known)" >&2; exit 2
        fi
    done
    kept=()
    for step in "${STEPS[@]}"; do
        [[ ",$ONLY," == *",${step%%|*},"* ]] && kept+=("$step")
    done
    STEPS=("${kept[@]}")
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
first_gpu=0 cpu_total=0 rest=0
for step in "${STEPS[@]}"; do
    IFS='|' read -r name limit where command <<<"$step"
    if [[ "$where" == cpu ]]; then
        cpu_total=$((cpu_total + limit)); beside=" (on the CPU, beside the first GPU step)"
    elif (( first_gpu == 0 )); then
        first_gpu=$limit; beside=""
    else
        rest=$((rest + limit)); beside=""
    fi
    echo "plan: $name (at most ${limit} s)$beside: $command > $OUT_DIR/$name.log"
done
total=$(( (first_gpu > cpu_total ? first_gpu : cpu_total) + rest ))
echo "plan: at most ${total} s in all; outputs under $OUT_DIR"
if (( total > 480 )); then echo "device_check: the plan's limits exceed 8 minutes (${total} s)" >&2; exit 1; fi

if (( DRY_RUN )); then
    failed=0
    for step in "${STEPS[@]}"; do
        IFS='|' read -r name limit where command <<<"$step"
        read -r -a cmd <<<"$command"
        check_step "$name" "${cmd[@]}" || failed=1
    done
    if ! "$PYTHON" -m benchmarks._device_check --help >/dev/null 2>&1; then
        echo "device_check: benchmarks/_device_check.py does not run" >&2; failed=1
    elif "$PYTHON" -m benchmarks._device_check preflight; then
        echo "check: every module the steps import imports here"
    else  # a plan check, not a GPU run: the benchmarks' extras may be missing here (CI installs .[dev] only)
        echo "check: the modules named above do not import here; a run with this Python stops before its steps"
    fi
    if (( failed )); then echo "dry run: the plan does not hold" >&2; exit 1; fi
    echo "dry run: every step's command exists and accepts its arguments"
    exit 0
fi

if ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "device_check: torch sees no GPU here; run with --dry-run to check the plan only" >&2
    exit 2
fi
if ! "$PYTHON" -m benchmarks._device_check preflight; then
    echo "device_check: install what is named above for $PYTHON (each step would fail on it); nothing ran" >&2
    exit 2
fi
mkdir -p "$OUT_DIR"
: >"$OUT_DIR/summary.txt"
"$PYTHON" -m benchmarks._device_check env >"$OUT_DIR/env.json" || echo "device_check: env.json not written" >&2

run_step() {  # name, limit, command: run it within its limit, its output to <name>.log, one line to summary.txt
    local name="$1" limit="$2" command="$3" started=$SECONDS rc
    local -a cmd
    read -r -a cmd <<<"$command"
    echo "device_check: $name (at most ${limit} s)" >&2
    timeout --kill-after=10 "$limit" "${cmd[@]}" >"$OUT_DIR/$name.log" 2>&1
    rc=$?
    echo "$name rc=$rc seconds=$((SECONDS - started))" | tee -a "$OUT_DIR/summary.txt"
    return "$rc"
}

cpu_steps=() gpu_steps=()
for step in "${STEPS[@]}"; do
    IFS='|' read -r name limit where command <<<"$step"
    if [[ "$where" == cpu ]]; then cpu_steps+=("$step"); else gpu_steps+=("$step"); fi
done
status=0 cpu_pid=""
if (( ${#cpu_steps[@]} )); then
    (
        failed=0
        for step in "${cpu_steps[@]}"; do
            IFS='|' read -r name limit where command <<<"$step"
            run_step "$name" "$limit" "$command" || failed=1
        done
        exit "$failed"
    ) &
    cpu_pid=$!
fi
for index in "${!gpu_steps[@]}"; do
    if (( index == 1 )) && [[ -n "$cpu_pid" ]]; then  # the benchmarks time alone: the CPU steps end first
        wait "$cpu_pid" || status=1; cpu_pid=""
    fi
    IFS='|' read -r name limit where command <<<"${gpu_steps[$index]}"
    run_step "$name" "$limit" "$command" || status=1
done
if [[ -n "$cpu_pid" ]]; then wait "$cpu_pid" || status=1; fi
"$PYTHON" -m benchmarks._device_check record "$OUT_DIR" || status=1
exit "$status"
