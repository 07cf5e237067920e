# Source on the device machine: installs the carried wheels (.whl/, ignored by git) into /tmp/site and puts
# them and the repository on PYTHONPATH. Usage inside a `run` command: `. tools/gpu_env.sh || exit 1; ...`
set -e
if ls .whl/*.whl >/dev/null 2>&1 && [ ! -f /tmp/site/.done ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  touch /tmp/site/.done
fi
# kernels/ is imported as megahybrid_kernels (pyproject.toml's package-dir mapping): a link stands in for it
mkdir -p /tmp/mhk && ln -sfn "$PWD/kernels" /tmp/mhk/megahybrid_kernels
export PYTHONPATH="$PWD:/tmp/mhk:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 MASTER_ADDR=127.0.0.1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
set +e
