#!/bin/sh
# The two base images deploy/Dockerfile starts from, made without a container registry, for a
# machine that reaches Debian's archive but not Docker Hub:
#   debian:bookworm-slim  Debian 12 from debootstrap (minbase), apt's lists and caches removed
#   rust:1-bookworm       that, with gcc and libc6-dev from Debian and the Rust toolchain that
#                         `rustc` here comes from (rustup's directory), on PATH, trusting the
#                         local CAs this machine trusts (/usr/local/share/ca-certificates: a
#                         TLS-inspecting proxy's), so that cargo reaches crates.io as it does here
# Then `docker build -f deploy/Dockerfile .` (or podman/buildah) uses them as it would the
# official ones. Needs root, debootstrap, and docker (or DOCKER=podman).
#   sudo deploy/offline-bases.sh [WORKDIR]
set -eu

docker=${DOCKER:-docker}
work=${1:-/var/tmp/gradsync-bases}
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
toolchain=$(rustc --print sysroot)
rust_version=$(rustc --version | cut -d' ' -f2)

mkdir -p "$work"
if [ ! -x "$work/slim/bin/sh" ]; then
    debootstrap --variant=minbase bookworm "$work/slim" "$mirror"
fi
rm -rf "$work/slim/var/lib/apt/lists/"* "$work/slim/var/cache/apt/archives/"*.deb
tar -C "$work/slim" -c . | "$docker" import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'CMD ["bash"]' - debian:bookworm-slim

rm -rf "$work/rust"
cp -a "$work/slim" "$work/rust"
cp /etc/resolv.conf "$work/rust/etc/resolv.conf"
mount -t proc proc "$work/rust/proc"
trap 'umount "$work/rust/proc" 2>/dev/null || true' EXIT
chroot "$work/rust" sh -c 'apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
    --no-install-recommends gcc libc6-dev ca-certificates && rm -rf /var/lib/apt/lists/*'
if ls /usr/local/share/ca-certificates/*.crt >/dev/null 2>&1; then
    cp /usr/local/share/ca-certificates/*.crt "$work/rust/usr/local/share/ca-certificates/"
    chroot "$work/rust" update-ca-certificates
fi
umount "$work/rust/proc"
# The toolchain without its documentation (share/doc is half its size).
mkdir -p "$work/rust/usr/local/rust"
tar -C "$toolchain" --exclude=./share/doc -c . | tar -C "$work/rust/usr/local/rust" -x
tar -C "$work/rust" -c . | "$docker" import \
    --change 'ENV PATH=/usr/local/rust/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV CARGO_HOME=/usr/local/cargo' \
    --change "LABEL org.opencontainers.image.description=\"Rust $rust_version on Debian 12, made by deploy/offline-bases.sh\"" \
    --change 'CMD ["bash"]' - rust:1-bookworm
"$docker" image ls debian:bookworm-slim
"$docker" image ls rust:1-bookworm
