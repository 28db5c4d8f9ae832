#!/usr/bin/env bash
# Reproduce every number in simulations/RESULTS.md (one core; ~1 hour in all).
# Usage: simulations/results.sh [STEP ...]   (steps: scale steady crash dissemination loss
# slow; default: all; dissemination-100k, frontier, switches, budget, baseline, tuning,
# tuning-fast and lossy-tcp run only when named; baseline, tuning and tuning-fast also feed
# docs/tuning.md via simulations.params). Outputs
# (CSV, PNG, markdown, and the console log with the seed and trace hash) go to
# simulations/results/<step>/.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=simulations/results
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(scale steady crash dissemination loss slow)

sim() {  # sim DIR ARGS...: one run, its console output kept next to its files
    local dir=$OUT/$1; shift
    mkdir -p "$dir"
    echo "\$ python -m simulations.run $* --out $dir" | tee -a "$dir/console.txt"
    "$PY" -m simulations.run "$@" --out "$dir" 2>&1 | tee -a "$dir/console.txt"
}

front() {  # front DIR ARGS...: one simulations.frontier sweep, its console output kept
    local dir=$OUT/$1; shift
    mkdir -p "$dir"
    echo "\$ python -m simulations.frontier $* --out $dir" | tee "$dir/console.txt"
    "$PY" -m simulations.frontier "$@" --out "$dir" 2>&1 | tee -a "$dir/console.txt"
}

scaling() {  # scaling DIR ARGS...: one simulations.scaling sweep, its console output kept
    local dir=$OUT/$1; shift
    mkdir -p "$dir"
    echo "\$ python -m simulations.scaling $* --out $dir" | tee "$dir/console.txt"
    "$PY" -m simulations.scaling "$@" --out "$dir" 2>&1 | tee -a "$dir/console.txt"
}

for step in "${steps[@]}"; do
    rm -rf "${OUT:?}/$step"
    case $step in
    scale) sim scale --scenario scale --nodes 10000 --duration-s 60 --seed 1 ;;
    steady) sim steady --scenario steady --nodes 100 --duration-s 60 --seed 1 ;;
    crash)
        # crashes one after another; at n = 10 three, so enough members stay to observe
        sim crash/n10 --scenario crash --nodes 10 --set crashes=3 --seed 1
        for n in 100 1000; do
            sim crash/n$n --scenario crash --nodes $n --set crashes=20 --seed 1
        done ;;
    dissemination) sim dissemination --scenario dissemination --nodes 10000 --seed 1 ;;
    dissemination-100k)  # not in the default set (~15 min, 2.4 GiB): the curve to 100,000
        sim dissemination-100k --scenario dissemination --nodes 100000 --seed 1 ;;
    loss)
        for n in 30 1000 10000; do
            sim loss/n$n --scenario loss --nodes $n --seed 1
        done ;;
    slow)
        for k in 1 2 4 8 16 32; do
            sim slow/k$k --scenario slow-members --nodes 100 --slow $k --lifeguard all --seed 1
        done ;;
    frontier)  # not in the default set (~35 min): variants × network conditions
        front frontier-n64 --nodes 64 --seeds 1,2 --crashes 8 \
            --conditions clean,loss5,loss10,loss20,jitter,slow1,slow4,worst
        front frontier-n1000 --nodes 1000 --seeds 1 --crashes 3 \
            --variants lan,local,fast,fast/static-timeout,fast/memberlist-suspicion,fast/no-verify \
            --conditions clean,loss10,slow4,worst ;;
    switches)  # ~50 min: the four faster-detection switches alone and together (§9)
        front frontier-switches-n64 --nodes 64 --seeds 1,2 --crashes 8 \
            --variants lan,fast/before-switches,fast/ring,fast/early,fast/cross,fast/confirmed,fast/all
        front frontier-verify-n64 --nodes 64 --seeds 1,2 --crashes 8 --variants fast,fast/verify-2
        front frontier-verify-worst-n64 --nodes 64 --crashes 8 --variants fast,fast/verify-2 \
            --conditions worst --seeds 1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16
        front frontier-small-group-n3 --nodes 3 --seeds 1-400 --crashes 1 \
            --variants fast,fast/no-small-group --conditions clean,loss10,loss20,jitter,slow1
        front frontier-switches-n1000 --nodes 1000 --seeds 1 --crashes 3 \
            --variants fast,fast/all --conditions clean,loss10,slow4,worst ;;
    budget)  # ~15 min: where a detection's time goes (§8)
        front budget-n64 --nodes 64 --seeds 1,2,3 --variants lan,fast \
            --conditions clean,loss10 --crashes 10
        front budget-n1000 --nodes 1000 --seeds 1,2 --variants lan,fast \
            --conditions clean --crashes 5 ;;
    baseline)  # ~85 min (n = 1,000 heartbeats): all-to-all heartbeat + Phi vs SWIM (§6)
        scaling baseline --nodes 10,100,1000 --variants lan,fast,heartbeat,heartbeat/fast \
            --conditions clean,loss1,loss10,slow1 --crashes 3,8,3 --seeds 1,2,3,4,5:1,2:1 ;;
    tuning)  # ~60 min (n = 10,000): docs/tuning.md §3
        scaling tuning --nodes 10,100,1000,10000 --variants lan,wan,local,fast \
            --conditions clean,loss1,loss10 --crashes 3,8,3,2 --seeds 1,2,3,4,5:1,2:1:1 ;;
    tuning-fast)  # ~70 min (n = 10,000): the fast rows of docs/tuning.md §3
        scaling tuning-fast --nodes 10,100,1000 --variants fast \
            --conditions clean,loss1,loss10 --crashes 3,8,3 --seeds 1,2,3,4,5:1,2:1
        scaling tuning-fast-10k --nodes 10000 --variants fast \
            --conditions clean,loss1,loss10 --crashes 2 --seeds 1
        scaling tuning-fast-lossy-tcp --nodes 10,100,1000 --variants fast \
            --conditions loss1,loss10 --crashes 3,8,3 --seeds 1,2,3,4,5:1,2:1 --lossy-tcp ;;
    lossy-tcp)  # ~1 min: RESULTS.md §7, TCP that can fail (n ≤ 100)
        scaling lossy-tcp --nodes 10,100 --variants lan,wan,local,fast \
            --conditions loss1,loss10 --crashes 3,8 --seeds 1,2,3,4,5:1,2 --lossy-tcp ;;
    *) echo "unknown step $step" >&2; exit 2 ;;
    esac
done
