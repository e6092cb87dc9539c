#!/usr/bin/env bash
# Makes .gpu-serve/ (git-ignored, ~45 MB): tritonserver.tar.xz, the tritonserver of .venv's
# nvidia-pytriton wheel trimmed to what `llm` needs on a GPU box (the server, the Python
# backend with the Python 3.12 stub of the GPU image, and the wheel's libraries that these
# link) and the numpy wheel of the stub, for `make gpu-bench`, which serves the benchmark's model through it when the file
# is there. Carry .gpu-serve beside the working tree.
set -euo pipefail
cd "$(dirname "$0")/.."
SITE=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
TS=pytriton/tritonserver
mkdir -p .gpu-serve
cd "$SITE"
LIBS=$(for f in $TS/bin/tritonserver $TS/backends/python/libtriton_python.so \
                $TS/python_backend_stubs/3.12/triton_python_backend_stub; do
           ldd "$f" | grep -o 'nvidia_pytriton.libs/[^ ]*'
       done | sort -u)
tar cf - $TS/bin $TS/backends/python/libtriton_python.so $TS/backends/python/triton_python_backend_utils.py \
    $TS/python_backend_stubs/3.12 $TS/caches $LIBS | xz -T0 -6 > "$OLDPWD/.gpu-serve/tritonserver.tar.xz"
cd "$OLDPWD"
# The stub's numpy: the Python backend of 2.51 reads BYTES tensors wrongly under numpy 2 (the
# GPU image's); its own numpy 1.26 for Python 3.12 goes first on the stub's path only.
.venv/bin/python -m pip download -q -d .gpu-serve --no-deps --only-binary=:all: --python-version 3.12 \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 numpy==1.26.4
ls -la .gpu-serve
