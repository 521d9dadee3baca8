#!/usr/bin/env bash
# Torch-compatibility job: the compatibility subset of the suite on every other supported
# torch (the main job runs the full suite on the pinned 2.13.0). Each version gets a
# throwaway venv inside the clone (registry torch builds other than the pinned CPU wheel
# are CUDA builds of about 3.5 GB; nothing is cached outside the clone), removed after.
# The next version's venv is built while the current one's subset runs.
#
#   bash .ci/compat.sh              # 2.11.0 and 2.15.0
#   bash .ci/compat.sh 2.12.0       # any list of versions
#   bash .ci/compat.sh --prepare    # only build the first default version's venv
#                                   # (.ci/run starts this before the main job)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
DEFAULT_VERSIONS=(2.11.0 2.15.0)

# Ops and their fake impls, fully_shard eager and compile + compiled autograd against
# FSDP2 on a small model (2 gloo ranks: the collectives' eager and traced paths), a
# float8-style weight's all-gather hooks traced by Dynamo, the graph-break tests, the
# recompile tests of the train loop and dynamic batch size, the compiled
# structure of reshard-after-forward and compiled inference, the backward-region rewrite
# (hooked into compiled autograd, feature-detected), the whole step as one graph (on 2.11
# through two patches of torch; with reshard_after_forward=N, its graph), the patches of
# torch (each one applied, and still needed on this torch), torch's pipeline schedules driving fully_shard stages against
# FSDP2 (what the schedules call changes between releases: 2.15's finalize backward
# through manual backward finalization), and that finalization, the reset after a
# failed backward and kept unsharded storage against FSDP2 (skipped before 2.15,
# whose FSDP2 lacks them), activation checkpointing against FSDP2 (it reads torch's
# checkpoint internals: its saved-tensor hooks and selective AC's dispatch modes), the
# module state FSDP2's users read, and low-precision gradients against FSDP2 (its
# mixed-precision dtypes and no-sync accumulation, which 2.15 changed: about 20 s, one
# 2-rank run; and that compiled, torch still cannot declare the gradient dtypes which
# would keep such gradients wide, one process), and that importing and using the package
# changes nothing of torch for the user's other workloads (their numbers, graphs and
# warnings against a process that never imported us). The main job runs the rest on the
# pinned torch.
# Then the GPU target check compiles every CUDA variant of the copy kernels for sm_80,
# sm_90 and sm_100 with this torch's Triton (no GPU; about 2 minutes on 2 cores).
FULLY_SHARD=tests/fsdp/test_fully_shard.py::test_fp32_training_matches_fsdp2_and_unsharded
EXTENSIONS=compile_tests/test_all_gather_extensions_compile.py
RECOMPILES=compile_tests/test_recompiles.py
FEATURES=tests/fsdp/test_fully_shard_features.py
SUBSET=(
  tests/collectives/test_ops.py
  "$FULLY_SHARD[2-eager-adamw]"
  "tests/fsdp/test_fully_shard.py::test_bf16_mixed_precision_within_fsdp2_error[compile-ca-aot-eager]"
  compile_tests/test_fully_shard_compile.py
  tests/_torch_patches/
  "$EXTENSIONS::test_compiled_all_gather_carries_float8_weights_as_bytes"
  "$EXTENSIONS::test_hooks_are_inlined_not_graph_ops"
  "$EXTENSIONS::test_hooks_set_after_fully_shard_compiled_within_1e5_of_fsdp2_eager"
  compile_tests/test_graph_breaks.py
  "$RECOMPILES::test_ten_steps_compile_once"
  "$RECOMPILES::test_changing_batch_size_with_dynamic_true_compiles_once"
  tests/backward_regions/test_outline.py
  compile_tests/test_block_compile.py::test_compiled_autograd_traces_one_block_backward
  compile_tests/test_whole_step.py
  tests/fsdp/features/test_reshard_after_forward_int.py::test_whole_step_keeps_the_piece_for_backward
  compile_tests/test_step_cache.py
  compile_tests/test_traced_optimizer.py
  tests/fsdp/features/test_pipeline_parallel.py
  tests/fsdp/test_backward_finalization.py
  tests/fsdp/test_activation_checkpointing.py
  tests/fsdp/test_module_state.py
  "$FEATURES::test_mixed_precision_dtype_combination_matches_fsdp2"
  "$FEATURES::test_no_gradient_sync_until_last_microbatch_matches_fsdp2"
  tests/collectives/test_grad_dtypes.py
  tests/test_import_side_effects.py
)

# The registry's triton-kernels and ours, imported side by side from outside the clone.
BOTH_KERNEL_PACKAGES='
import triton_kernels, fsdp_traceable.triton_kernels as ours
assert "site-packages" in triton_kernels.__file__ and ours.__file__ != triton_kernels.__file__
print("triton_kernels:", triton_kernels.__file__, "| ours:", ours.__file__)'

venv_of() { echo ".ci-venvs/torch-$1"; }

# Builds the venv of torch $1 (once: a finished venv is marked and kept).
install() {
  local version=$1 venv start=$SECONDS
  venv=$(venv_of "$version")
  [ -f "$venv/.installed" ] && return 0
  rm -rf "$venv"
  mkdir -p .ci-venvs
  "$PYTHON" -m venv "$venv"
  # pip's configuration files may cap torch (a machine-wide constraints file pinning
  # the main job's release); this venv asks for another release, so they are not read.
  local pip=(env PIP_CONFIG_FILE=/dev/null "$venv/bin/pip")
  "${pip[@]}" install -q --no-compile "torch==$version"
  # transformers for the whole-step test's Hugging Face Llama case, pinned as the main job's.
  "${pip[@]}" install -q --no-compile pytest pytest-xdist expecttest hypothesis numpy \
    "$(grep -o 'transformers==[0-9.]*' pyproject.toml)"
  "${pip[@]}" install -q --no-compile --no-deps -e .
  # Another package named triton_kernels, installed beside ours (see tests/test_packaging.py).
  "${pip[@]}" install -q --no-compile --no-deps triton-kernels==0.1.0
  touch "$venv/.installed"
  echo "torch $version: installed in $((SECONDS - start)) s"
}

if [ "${1:-}" = "--prepare" ]; then
  install "${DEFAULT_VERSIONS[0]}"
  exit 0
fi
VERSIONS=("$@")
[ ${#VERSIONS[@]} -gt 0 ] || VERSIONS=("${DEFAULT_VERSIONS[@]}")

status=0
for i in "${!VERSIONS[@]}"; do
  version=${VERSIONS[$i]}
  venv=$(venv_of "$version")
  start=$SECONDS
  install "$version"
  next_pid=
  if [ $((i + 1)) -lt ${#VERSIONS[@]} ]; then
    # Its output is kept apart from the running subset's and shown after it.
    install "${VERSIONS[$((i + 1))]}" > .ci-venvs/next-install.log 2>&1 &
    next_pid=$!
  fi
  set +e
  TORCHINDUCTOR_CACHE_DIR="$PWD/$venv/inductor_cache" \
    "$venv/bin/python" -m pytest -q -p no:cacheprovider -n 2 --dist loadfile --durations=10 \
    "${SUBSET[@]}"
  rc=$?
  "$venv/bin/python" -m tests.triton_kernels.gpu_targets
  gpu_rc=$?
  (cd / && "$OLDPWD/$venv/bin/python" -c "$BOTH_KERNEL_PACKAGES")
  names_rc=$?
  set -e
  echo "torch $version: compatibility subset exit $rc, GPU target check exit $gpu_rc," \
    "both triton_kernels exit $names_rc after $((SECONDS - start)) s"
  rm -rf "$venv"
  if [ $rc -ne 0 ] && [ $rc -ne 5 ] && [ $status -eq 0 ]; then status=$rc; fi
  if [ $gpu_rc -ne 0 ] && [ $status -eq 0 ]; then status=$gpu_rc; fi
  if [ $names_rc -ne 0 ] && [ $status -eq 0 ]; then status=$names_rc; fi
  # A failed background build is retried (and reported) by the next iteration.
  if [ -n "$next_pid" ]; then
    wait "$next_pid" || true
    cat .ci-venvs/next-install.log
    rm -f .ci-venvs/next-install.log
  fi
done
rmdir .ci-venvs 2>/dev/null || true
exit $status
