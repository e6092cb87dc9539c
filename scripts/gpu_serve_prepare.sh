#!/usr/bin/env bash
# Makes .gpu-serve/tritonserver.tar.xz (git-ignored, ~27 MB): the tritonserver of .venv's
# nvidia-pytriton wheel trimmed to what `llm` needs on a GPU box (the server, the Python
# backend with the Python 3.12 stub of the GPU image, and the wheel's libraries that these
# link), for `make gpu-bench`, which serves the benchmark's model through it when the file
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
ls -la "$OLDPWD/.gpu-serve/tritonserver.tar.xz"
