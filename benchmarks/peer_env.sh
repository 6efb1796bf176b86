#!/usr/bin/env bash
# Build (or reuse) ENV_DIR: the peers' own Python environment for benchmarks/peer_fidelity.py, outside the repository.
#   benchmarks/peer_env.sh /work/peerenv
# The peers get a virtualenv of their own, apart from dstc's (transformers 5.x), with the versions below, pinned:
# transformers 4.57.6 is what llama.cpp's GGUF converter pins and what optimum-intel 2.1.0 needs for Qwen2 (>= 4.57).
# optimum-intel refuses DeepSeek above 4.53.3, and on 4.53.3 its DeepSeek patches fail on transformers' own
# DeepseekV3 ("unexpected keyword argument 'cache_position'": they patch the hub's remote-code modeling_deepseek.py)
# while 4.53.3 has no DeepseekV2 at all: benchmarks/peer_fidelity.py records that refusal. llama.cpp is built once from
# llama-cpp-python's sdist (it vendors llama.cpp, its GGUF converter and gguf-py): shared libraries and the
# llama-imatrix / llama-quantize tools; the sdist's pure-Python ctypes bindings (llama_cpp) are copied into the
# venv with the libraries beside them, so that llama.cpp is compiled once, not a second time by pip.
# Idempotent: each step leaves a stamp in ENV_DIR/.stamps and is skipped when its stamp is there.
set -euo pipefail
env_dir=${1:?usage: peer_env.sh ENV_DIR}
mkdir -p "$env_dir/.stamps"
env_dir=$(cd "$env_dir" && pwd)
python=${PYTHON:-python3.11}
jobs=${JOBS:-2}

TORCH=2.13.0                 # the CPU build install.sh uses
TRANSFORMERS=4.57.6
OPTIMUM_INTEL=2.1.0          # 2.2.0 requires torchvision, which PyPI does not ship for this torch build
OPTIMUM=2.3.0
NNCF=3.4.0                   # the same NNCF and OpenVINO as dstc's own environment
OPENVINO=2026.4.1
OPENVINO_TOKENIZERS=2026.4.1.0
LLAMA_CPP_PYTHON=0.3.36
SENTENCEPIECE=0.2.3          # llama.cpp's GGUF converter imports it
DISKCACHE=5.6.3              # llama-cpp-python's bindings import it

stamp() { [ -e "$env_dir/.stamps/$1" ]; }
done_() { date -u +%FT%TZ >"$env_dir/.stamps/$1"; }
pip() { "$env_dir/bin/python" -m pip --disable-pip-version-check "$@"; }

[ -x "$env_dir/bin/python" ] || "$python" -m venv "$env_dir"

packages="torch==$TORCH transformers==$TRANSFORMERS optimum-intel==$OPTIMUM_INTEL optimum==$OPTIMUM nncf==$NNCF"
packages+=" openvino==$OPENVINO openvino-tokenizers==$OPENVINO_TOKENIZERS sentencepiece==$SENTENCEPIECE"
packages+=" diskcache==$DISKCACHE"
packages_stamp="python-packages-$(echo "$packages" | sha256sum | cut -c1-12)"  # new pins: install again
if ! stamp "$packages_stamp"; then
    pip install -q "torch==$TORCH"
    # shellcheck disable=SC2086
    pip install -q $packages "numpy<2.5" safetensors psutil protobuf
    done_ "$packages_stamp"
fi

src="$env_dir/src/llama_cpp_python-$LLAMA_CPP_PYTHON"
if ! stamp llama-source; then
    mkdir -p "$env_dir/src"
    pip download -q --no-deps --no-binary :all: -d "$env_dir/src" "llama-cpp-python==$LLAMA_CPP_PYTHON"
    rm -rf "$src"
    tar -xzf "$env_dir/src/llama_cpp_python-$LLAMA_CPP_PYTHON.tar.gz" -C "$env_dir/src"
    done_ llama-source
fi

build="$env_dir/llama.cpp-build"
# GGML_NATIVE compiles for this CPU's instructions: keyed on its flags, a machine with another CPU builds again
cpu=$(grep -m1 '^flags' /proc/cpuinfo | sha256sum | cut -c1-12)
if ! stamp "llama-build-$cpu"; then
    cmake -S "$src/vendor/llama.cpp" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON \
        -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
        -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TOOLS=ON
    cmake --build "$build" -j "$jobs" --target llama llama-imatrix llama-quantize
    rm -f "$env_dir/.stamps/llama-python"  # the libraries beside the bindings are copied again
    done_ "llama-build-$cpu"
fi

if ! stamp llama-python; then
    site=$("$env_dir/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    rm -rf "$site/llama_cpp"
    cp -r "$src/llama_cpp" "$site/llama_cpp"
    mkdir -p "$site/llama_cpp/lib"
    cp -P "$build"/bin/lib*.so* "$site/llama_cpp/lib/"
    pip install -q "$src/vendor/llama.cpp/gguf-py"
    done_ llama-python
fi

"$env_dir/bin/python" - <<'EOF'
import llama_cpp, nncf, openvino, optimum.intel, torch, transformers
print(f"peer env ok: transformers {transformers.__version__}, torch {torch.__version__}, openvino {openvino.__version__},"
      f" nncf {nncf.__version__}, llama.cpp bindings {llama_cpp.__version__}")
EOF
ls "$build/bin/llama-imatrix" "$build/bin/llama-quantize" >/dev/null
