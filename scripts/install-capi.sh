#!/usr/bin/env bash
# Builds the C API in release mode and installs it under PREFIX (default /usr/local):
#   PREFIX/lib/libuniop.so, PREFIX/lib/libuniop.a, PREFIX/include/uniop.h, PREFIX/lib/pkgconfig/uniop.pc
# Then: gcc app.c $(pkg-config --cflags --libs uniop)   (static: pkg-config --static, libuniop.a)
set -euo pipefail
cd "$(dirname "$0")/.."
prefix="$(realpath -m "${1:-/usr/local}")"
cargo build --release --locked -p uniop-capi
version="$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)"
mkdir -p "$prefix/lib/pkgconfig" "$prefix/include"
install -m 755 target/release/libuniop_capi.so "$prefix/lib/libuniop.so"
install -m 644 target/release/libuniop_capi.a "$prefix/lib/libuniop.a"
install -m 644 include/uniop.h "$prefix/include/uniop.h"
sed -e "s|@PREFIX@|$prefix|" -e "s|@VERSION@|$version|" scripts/uniop.pc.in >"$prefix/lib/pkgconfig/uniop.pc"
echo "installed uniop $version C API under $prefix"
