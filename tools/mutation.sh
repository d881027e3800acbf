#!/usr/bin/env bash
# Mutation testing with mutmut (pip install -e ".[mutation]"): how many small changes to the code do the fast tests
# notice? Mutates common/sampling, common/memory, common/engine/scheduler.py, common/weights.py,
# common/loader/checkpoint.py and common/layers, and runs, for each mutant, the tests of MUTATION_TESTS that call
# the mutated function. Not part of CI: it takes well over an hour on 2 cores (MUTATION_JOBS children, default 1).
#
#   tools/mutation.sh                  # mutate the committed tree (HEAD), print the score, leave results in $WORK
#   MUTATION_WORK=/tmp/x tools/mutation.sh
#   tools/mutation.sh 'omnirun.weights*'   # only mutants whose name matches (mutmut's own filter)
#   MUTATION_REV=<commit or tree> MUTATION_ONLY="omnirun/weights.py omnirun/engine/scheduler.py" tools/mutation.sh
#
# The installed omnirun's pytest plugin (entry point pytest11) is imported from the copy (mutants/ comes first on
# sys.path), so a commit that has omnirun/conformance/plugin.py needs nothing more. Only for older commits, whose
# root conftest adds --device itself, run with PYTEST_ADDOPTS="-p no:omnirun" (on HEAD that flag breaks the root
# conftest, which reads --device from the plugin).
#
# The committed tree is copied to $WORK with common/ renamed to omnirun/ (and devices/ inside it): mutmut names
# mutants by file path and imports them from mutants/, so the path has to be the import name. The checkout itself
# is never touched. Survivors: `cd $WORK && mutmut results`, `mutmut show <name>`; see tools/mutation_survivors.md.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
WORK="${MUTATION_WORK:-/tmp/omnirun-mutation}"
REV="${MUTATION_REV:-HEAD}"  # the commit to mutate
# Files to mutate (globs, with omnirun/ for common/); MUTATION_ONLY narrows the run to fewer of them.
read -r -a ONLY <<< "${MUTATION_ONLY:-omnirun/sampling/* omnirun/memory/* omnirun/engine/scheduler.py omnirun/weights.py omnirun/loader/checkpoint.py omnirun/layers/*}"

# Fast tests of the mutated modules (the whole set runs in about 40 s); slow end-to-end ones stay out.
MUTATION_TESTS=(
    tests/test_sampling.py
    tests/test_sampling_adjust.py  # (penalties, logit bias, min_tokens: common/sampling/adjust.py)
    tests/test_kv_memory.py
    tests/test_kv_sizing.py
    tests/test_page_allocator.py
    tests/test_scheduler_policy.py
    tests/test_weight_checks.py
    tests/test_loader.py
    tests/test_layers.py
    tests/test_linear_bias.py
    tests/test_triton_gemv.py tests/kernels/test_triton_gemv.py  # (the kernels' tests moved to tests/kernels)
    tests/test_triton_ops.py tests/kernels/test_triton_ops.py
    "omnirun/conformance/test_runner_vs_hf.py::test_prefill_logits_match_hf[llama-16-plain]"
    "omnirun/conformance/test_runner_vs_hf.py::test_prefill_logits_match_hf[qwen2-1-sharded]"
    "omnirun/conformance/test_runner_vs_hf.py::test_prefill_logits_match_hf[qwen3-16-plain]"
    "omnirun/conformance/test_runner_vs_hf.py::test_prefill_logits_match_hf[mistral-1-plain]"
    omnirun/conformance/test_weight_updates.py  # (common/ is omnirun/ in the copy)
)
# Tests that start another python process (which would import the unmutated package) or only time imports.
DESELECT=(
    tests/test_loader.py::test_dummy_weights_are_the_same_in_another_process
    tests/test_triton_ops.py::test_importing_the_gpu_platforms_does_not_import_triton
    tests/kernels/test_triton_ops.py::test_importing_the_gpu_platforms_does_not_import_triton
)

rm -rf "$WORK"
mkdir -p "$WORK"
git -C "$ROOT" archive "$REV" | tar -x -C "$WORK"
cd "$WORK"
mv common omnirun
mv devices omnirun/devices
rm -rf bench ci tools .ci .github README.md
selected=()
# (then the tests written for survivors)
for test in "${MUTATION_TESTS[@]}" tests/test_{weight_updates_tied_and_reads,sampling_params_checks,safetensors_index_errors,kv_bookkeeping,scheduler_limits,layer_details,tp_weights_in_process}.py; do
    if [[ -e "${test%%::*}" ]]; then selected+=("$test"); fi
done

{
    echo "[mutmut]"
    echo "source_paths = omnirun/"
    echo "only_mutate ="
    for pattern in "${ONLY[@]}"; do echo "    $pattern"; done
    echo "pytest_add_cli_args_test_selection ="
    for test in "${selected[@]}"; do echo "    $test"; done
    echo "pytest_add_cli_args ="
    echo "    -p"
    echo "    no:cacheprovider"
    for test in "${DESELECT[@]}"; do echo "    --deselect=$test"; done
    # torch's thread pools do not survive a fork of a process that used them: fork from a clean server instead.
    echo "process_isolation = forkserver"
} > setup.cfg
# mutmut imports the mutants from mutants/ (put first on sys.path); it must exist before python starts, or the
# import system remembers it as missing and the checkout's editable install is imported instead.
mkdir -p mutants
mv conftest.py mutants/  # pytest in mutants/ must see one root conftest, not also this one above it
export PYTHONPATH="$WORK/mutants${PYTHONPATH:+:$PYTHONPATH}"
export TRITON_INTERPRET=1 OMP_NUM_THREADS=1
mutmut run --max-children "${MUTATION_JOBS:-1}" "$@" > mutmut.log 2>&1 || true  # a progress spinner: log only
mutmut results --all true > results.txt
python "$ROOT/tools/mutation_score.py" results.txt | tee score.txt
