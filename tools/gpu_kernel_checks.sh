#!/usr/bin/env bash
# The kernel checks of docs/benchmarks.md ("Kernel checks on a GPU"), on a GPU machine without the two kernel
# packages installed (neither publishes a wheel such a machine can take). Give their sources:
#   FHT_SRC=<a checkout of Dao-AILab/fast-hadamard-transform>  (csrc/ and fast_hadamard_transform/)
#   MAMBA_SDIST=<mamba_ssm-2.3.2.post1.tar.gz, its PyPI source>
#   bash tools/gpu_kernel_checks.sh
# fast_hadamard_transform is built for this GPU's architecture only (torch.utils.cpp_extension.load, nvcc);
# mamba_ssm's Triton kernels are loaded from its source with the package __init__ emptied (it imports the CUDA
# extension, which these kernels do not need and which is not built here).
set -uo pipefail
export PYTHONPATH=${PYTHONPATH:-}:$PWD
rc=0
if [ -n "${FHT_SRC:-}" ]; then
  build=$(mktemp -d)
  arch=$(python3 -c "import torch; print(''.join(map(str, torch.cuda.get_device_capability())))")
  (cd "$FHT_SRC" && MAX_JOBS=${MAX_JOBS:-4} python3 -c "
from torch.utils.cpp_extension import load
flags = ['-O3', '-gencode', 'arch=compute_$arch,code=sm_$arch', '--expt-relaxed-constexpr', '--expt-extended-lambda',
         '--use_fast_math'] + ['-U__CUDA_NO_%s__' % m for m in ('HALF_OPERATORS', 'HALF_CONVERSIONS', 'BFLOAT16_OPERATORS',
                                                                 'BFLOAT16_CONVERSIONS', 'BFLOAT162_OPERATORS', 'BFLOAT162_CONVERSIONS')]
load(name='fast_hadamard_transform_cuda', sources=['csrc/fast_hadamard_transform.cpp', 'csrc/fast_hadamard_transform_cuda.cu'],
     extra_cflags=['-O3'], extra_include_paths=['.'], extra_cuda_cflags=flags, build_directory='$build')
") || rc=1
  PYTHONPATH=$build:$FHT_SRC:$PYTHONPATH python3 -m pytest -m gpu -q -s -rA -p no:cacheprovider -o addopts="" \
    tests/unit/trainer/megatron/test_dsa.py -k kernel || rc=1
fi
if [ -n "${MAMBA_SDIST:-}" ]; then
  src=$(mktemp -d)
  tar xzf "$MAMBA_SDIST" -C "$src" && pkg=$(ls -d "$src"/mamba_ssm-*) && : > "$pkg/mamba_ssm/__init__.py"
  PYTHONPATH=$pkg:$PYTHONPATH python3 -m pytest -m gpu -q -s -rA -p no:cacheprovider -o addopts="" \
    tests/unit/test_mamba_scan.py -k kernel || rc=1
fi
exit $rc
