#!/usr/bin/env bash
# Build an emulated AArch64 board: an arm64 CPython 3.11 from Debian's packages plus the aarch64
# wheels of apache-tvm (and what `planner board serve` imports), run under qemu-user through
# binfmt_misc. A cross-compiled training step then really runs on AArch64 on this x86 machine.
#
#   tests/emulated_board/build.sh [DIR]      # default: $PLANNER_EMU_DIR or ~/.cache/planner/aarch64-board
#
# Needs root (apt-get, binfmt_misc). Idempotent: DIR/ready names the wheels installed; a board built
# with another list gets the new list's wheels (the Python is kept). Serve with:
#   QEMU_LD_PREFIX=DIR/root PYTHONPATH=DIR/site:REPO DIR/root/usr/bin/python3.11 -m planner board serve ...
set -euo pipefail
dir="${1:-${PLANNER_EMU_DIR:-$HOME/.cache/planner/aarch64-board}}"
root="$dir/root" site="$dir/site"

register_binfmt() {
  [ -d /proc/sys/fs/binfmt_misc ] || return 1
  [ -e /proc/sys/fs/binfmt_misc/register ] || mount binfmt_misc -t binfmt_misc /proc/sys/fs/binfmt_misc
  [ -e /proc/sys/fs/binfmt_misc/qemu-aarch64 ] || cat /usr/lib/binfmt.d/qemu-aarch64.conf > /proc/sys/fs/binfmt_misc/register
}

if ! command -v qemu-aarch64-static >/dev/null; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq qemu-user-static >/dev/null
fi
register_binfmt
# what `planner board serve` imports, and OpenBLAS (the steps' dense convolutions call it)
wheels=(apache-tvm==0.27.0.post1 apache-tvm-ffi==0.1.14.post0 numpy ml_dtypes typing_extensions psutil
        cloudpickle tornado typer rich click shellingham markdown-it-py mdurl pygments annotated-doc
        pydantic pydantic-core annotated-types typing-inspection scipy-openblas32)
[ -f "$dir/ready" ] && [ "$(cat "$dir/ready")" = "${wheels[*]}" ] && exit 0

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
mkdir -p "$root" "$site"

# 1. an arm64 Python, unpacked (no debootstrap, no chroot: qemu finds libraries via QEMU_LD_PREFIX)
debs=(python3.11-minimal libpython3.11-minimal libpython3.11-stdlib libc6 libexpat1 zlib1g libstdc++6
      libgcc-s1 libffi8 libssl3 libbz2-1.0 liblzma5 libsqlite3-0 libncursesw6 libtinfo6 libreadline8
      libuuid1 libgdbm6 libnsl2 libtirpc3 libcrypt1 libgssapi-krb5-2 libkrb5-3 libk5crypto3
      libkrb5support0 libcom-err2 libkeyutils1 libzstd1)
if [ ! -x "$root/usr/bin/python3.11" ]; then
  if ! dpkg --print-foreign-architectures | grep -qx arm64; then dpkg --add-architecture arm64; fi
  apt-get update -qq
  (cd "$work" && apt-get download -qq "${debs[@]/%/:arm64}")
  for deb in "$work"/*.deb; do dpkg -x "$deb" "$root"; done
fi

# 2. aarch64 wheels for CPython 3.11, unzipped into one site folder
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.11 --implementation cp \
  --platform manylinux_2_28_aarch64 --platform manylinux_2_27_aarch64 --platform manylinux_2_17_aarch64 \
  --platform manylinux2014_aarch64 -d "$work/wheels" "${wheels[@]}"
for whl in "$work"/wheels/*.whl; do python3 -m zipfile -e "$whl" "$site"; done

echo "${wheels[*]}" > "$dir/ready"
echo "emulated AArch64 board ready in $dir"
