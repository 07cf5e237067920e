# Source on the device machine: installs the carried wheels (.whl/, ignored by git) into /tmp/site and puts
# them and the repository on PYTHONPATH. Usage inside a `run` command: `. tools/gpu_env.sh || exit 1; ...`
set -e
if ls .whl/*.whl >/dev/null 2>&1 && [ ! -f /tmp/site/.done ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  touch /tmp/site/.done
fi
export PYTHONPATH="$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 MASTER_ADDR=127.0.0.1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
set +e
