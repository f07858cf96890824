#!/usr/bin/env bash
# The checks that need a CUDA GPU, for a machine that has one (the development and CI machines
# do not; there these tests skip). Runs from the repository root with that machine's own Python,
# torch and transformers, importing Tether from src/ (nothing is installed):
#
#   bash scripts/device_check.sh          # log to $OUT/device_check.log, or ./device-check/
#
# What it checks: the engine on CUDA (log-probs against a teacher-forced forward, seeding, a
# weight load from CPU tensors, the lean decoder against the transformers forward) and a rollout
# worker on CUDA, i.e. what a Ray actor with ray.gpus_per_worker > 0 runs; the learner on CUDA
# (train.device=cuda) step for step against the CPU learner (also with micro-batches packed by a
# token budget, train.max_tokens_per_micro_batch), its checkpoint loading on a CPU, and
# held-out evaluation on the device, a bfloat16 learner (train.dtype) and engine (rollout.dtype)
# on the device against the float32 ones, and with two or more GPUs the learner's NCCL ranks
# (train.world_size=2) against one GPU, and the learner with train.activation_checkpointing against
# one without it (the same steps, a lower peak of allocated memory), and two ranks with
# train.cpu_offload (FSDP2's CPUOffloadPolicy) against one GPU (tests marked `gpu`); where diffusers is installed, a
# diffusers pipeline's rollout worker on the GPU in float32 and bfloat16 against the CPU learner;
# the collective weight channel's broadcast on CUDA (NCCL, and gloo carrying CUDA tensors);
# then the engine and learner benchmarks
# on the GPU (engine_cuda.json and learner_cuda.json beside the log); and, where vLLM's CUDA build is
# installed, the vLLM engine on the GPU beside the built-in one (tokens/s, weight loads, its
# log-probs against a transformers forward: vllm_cuda.json). Ray itself is not needed
# (its wheel is larger than what can travel to the device machine here).
set -uo pipefail
out="${OUT:-device-check}"
mkdir -p "$out"
py="${PYTHON:-python3}"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
{
  nvidia-smi -L || true
  "$py" -c "import sys, torch, transformers; print('torch', torch.__version__, '| cuda', torch.cuda.is_available(), '| transformers', transformers.__version__); sys.exit(0 if torch.cuda.is_available() else 'no CUDA device here: nothing to check')" || exit 1
  "$py" -m pytest -q -p no:cacheprovider -o addopts=-ra -m gpu tests/integration/test_gpu.py
  status=$?
  # the collective weight channel on CUDA: NCCL (a second GPU, or one shared) and gloo with CUDA tensors
  "$py" -m pytest -q -p no:cacheprovider -o addopts=-ra -m gpu tests/integration/test_collective_channel.py \
    || status=1
  if "$py" -c "import diffusers" 2>/dev/null; then
    # a diffusers pipeline's rollout worker on the GPU, float32 and flow.dtype=bfloat16
    "$py" -m pytest -q -s -p no:cacheprovider -o addopts=-ra -m gpu tests/integration/test_flow_diffusers.py \
      || status=1
  else
    echo "diffusers is not installed for $py: the flow pipeline on CUDA was not checked"
  fi
  "$py" benchmarks/engine.py --device cuda --size small --repeats 5
  "$py" benchmarks/engine.py --device cuda --size base --repeats 5 --json | tee "$out/engine_cuda.json"
  "$py" benchmarks/learner.py --device cuda --repeats 10 --json | tee "$out/learner_cuda.json"
  if "$py" -c "import vllm" 2>/dev/null; then
    "$py" benchmarks/vllm_engine.py --device cuda --sizes small,base --json | tee "$out/vllm_cuda.json"
  else
    echo "vLLM is not installed for $py: the vLLM engine on CUDA was not checked"
  fi
  exit "$status"
} 2>&1 | tee "$out/device_check.log"
exit "${PIPESTATUS[0]}"
