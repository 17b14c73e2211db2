#!/usr/bin/env bash
# benchmarks/gpu.py on a bare Linux machine with an NVIDIA GPU and no network (the GPU machines this
# project is lent). Bring in the checkout: .gl/*.deb (Debian's libvulkan1 libegl1 libglvnd0 libopengl0
# libgl1 libglx0 libgles2, `apt-get download`) and .whl/*.whl (onnxruntime==1.32.0,
# onnxruntime-ep-webgpu and what the coordinator needs beyond that machine's Python packages).
# Usage: bash benchmarks/gpu_on_nvidia.sh [benchmarks/gpu.py flags]
set -u
for f in .gl/*.deb; do dpkg -x "$f" /; done
ldconfig
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1  # $PWD: the checkout, whose edgepipe the benchmark imports
# The NVIDIA driver's Vulkan ICD and EGL vendor files, where the driver is mounted under /usr/local/nvidia:
export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
export __EGL_VENDOR_LIBRARY_FILENAMES=/usr/local/nvidia/share/glvnd/egl_vendor.d/10_nvidia.json
nvidia-smi -L
python3 -c "import onnxruntime as o; print('onnxruntime', o.__version__)"
python3 benchmarks/gpu.py "$@"
