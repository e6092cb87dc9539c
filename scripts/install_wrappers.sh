#!/usr/bin/env bash
# Puts the Python backend stub where tritonserver looks for it, and writes
# .venv/bin/tritonserver and .venv/bin/perf_analyzer wrappers that set the
# environment the stub and perf_analyzer need (see ../shared/PLATFORM.md).
set -euo pipefail
VENV=$(cd "$1" && pwd)
SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
PYVER=$("$VENV/bin/python" -c 'import sys; print(f"{sys.version_info.major}.{sys.version_info.minor}")')
LIBPY=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_config_var("LIBDIR"))')
TS=$SITE/pytriton/tritonserver
cp "$TS/python_backend_stubs/$PYVER/triton_python_backend_stub" "$TS/backends/python/"

# perf_analyzer from tritonclient[all] is the real binary; move it aside once.
if [ -f "$VENV/bin/perf_analyzer" ] && ! grep -q TANDEM_WRAPPER "$VENV/bin/perf_analyzer" 2>/dev/null; then
    mv "$VENV/bin/perf_analyzer" "$VENV/bin/perf_analyzer.bin"
fi

cat > "$VENV/bin/tritonserver" <<WRAP
#!/usr/bin/env bash
# TANDEM_WRAPPER: the tritonserver 2.51 shipped in nvidia-pytriton, with the
# environment its Python backend stub needs (libpython, the venv first on PATH).
export PATH="$VENV/bin:\$PATH"
export LD_LIBRARY_PATH="$LIBPY:$SITE/nvidia_pytriton.libs:$TS/backends/python:\${LD_LIBRARY_PATH:-}"
exec "$TS/bin/tritonserver" --backend-directory "$TS/backends" "\$@"
WRAP

cat > "$VENV/bin/perf_analyzer" <<WRAP
#!/usr/bin/env bash
# TANDEM_WRAPPER: perf_analyzer 2.51 from tritonclient[all], with libcudart on the path.
export LD_LIBRARY_PATH="$SITE/nvidia/cuda_runtime/lib:\${LD_LIBRARY_PATH:-}"
exec "$VENV/bin/perf_analyzer.bin" "\$@"
WRAP
chmod +x "$VENV/bin/tritonserver" "$VENV/bin/perf_analyzer"
